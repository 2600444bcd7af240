"""Files by path or URL: a local path, or any fsspec URL (``s3://bucket/shards``, ``gs://…``, ``file://…``),
as img2dataset reads and writes them.

Local paths stay :class:`~pathlib.Path` objects and are opened directly; a URL is opened through fsspec (for
``s3://`` the ``s3fs`` package reads ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and
``AWS_ENDPOINT_URL`` from the environment, as boto does).
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

Location = str | Path


def is_url(path: Location) -> bool:
    """Whether ``path`` names a file through a protocol (``s3://…``) rather than a local path."""
    return "://" in str(path)


def as_location(path: Location) -> Location:
    """A URL as its string, a local path as a :class:`Path`."""
    return str(path) if is_url(path) else Path(path)


def open_binary(path: Location, mode: str = "rb") -> IO[bytes]:
    """A binary file object for a local path or URL (``"rb"`` or ``"wb"``)."""
    if not is_url(path):
        return open(path, mode)
    import fsspec

    return fsspec.open(str(path), mode).open()


def file_size(path: Location) -> int:
    """Bytes in the file."""
    if not is_url(path):
        return Path(path).stat().st_size
    fs, inner = _filesystem(path)
    return int(fs.size(inner))


def glob(folder: Location, pattern: str) -> list[Location]:
    """The files of ``folder`` matching ``pattern`` (e.g. ``*.tar``), sorted, as URLs or Paths like ``folder``.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
    """
    if not is_url(folder):
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"shard folder {folder} does not exist")
        return sorted(folder.glob(pattern))
    fs, inner = _filesystem(folder)
    if not fs.isdir(inner):
        raise FileNotFoundError(f"shard folder {folder} does not exist")
    return sorted(fs.unstrip_protocol(found) for found in fs.glob(f"{inner.rstrip('/')}/{pattern}"))


def put(files: list[Path], folder: str) -> list[str]:
    """Copies local ``files`` into the URL ``folder``, made first if missing (a bucket included, as img2dataset
    does); an object store writes each file whole, so readers never see half a file. Returns their URLs."""
    fs, inner = _filesystem(folder)
    fs.makedirs(inner, exist_ok=True)
    targets = []
    for local in files:
        target = f"{inner.rstrip('/')}/{local.name}"
        fs.put_file(str(local), target)
        targets.append(fs.unstrip_protocol(target))
    return targets


def name(path: Location) -> str:
    """The file name: the last part of the path or URL."""
    return str(path).rstrip("/").rpartition("/")[2]


def _filesystem(url: Location):
    import fsspec

    return fsspec.core.url_to_fs(str(url))
