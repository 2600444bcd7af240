"""Files by path or URL: a local path, or any fsspec URL (``s3://bucket/shards``, ``gs://…``, ``file://…``),
as img2dataset reads and writes them.

Local paths stay :class:`~pathlib.Path` objects and are opened directly; a URL is opened through fsspec (for
``s3://`` the ``s3fs`` package reads ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and
``AWS_ENDPOINT_URL`` from the environment, as boto does).
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

from vip_core.atomic import atomic_path

Location = str | Path


def is_url(path: Location) -> bool:
    """Whether ``path`` names a file through a protocol (``s3://…``) rather than a local path."""
    return "://" in str(path)


def as_location(path: Location) -> Location:
    """A URL as its string, a local path as a :class:`Path`."""
    return str(path) if is_url(path) else Path(path)


def join(location: Location, *parts: str) -> Location:
    """``parts`` below ``location``: a URL joined with ``/`` (its ``//`` kept), a local path as a :class:`Path`."""
    if not is_url(location):
        return Path(location, *parts)
    return "/".join([str(location).rstrip("/"), *(part.strip("/") for part in parts)])


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


def listing(folder: str) -> dict[str, dict[str, Any]]:
    """Every file below the URL ``folder``, by its path relative to ``folder``, with what the store lists of it
    (size, ETag or modification time): read afresh, so it changes whenever a file is added, removed or rewritten.

    Raises:
        FileNotFoundError: no file below ``folder``.
    """
    fs, inner = _existing_folder(folder)
    return {found[len(inner) + 1:]: info for found, info in fs.find(inner, detail=True).items()}


def tree(folder: Location) -> dict[str, list]:
    """Every file below ``folder`` (at any depth; a dangling link included), by its ``/``-separated path relative
    to ``folder``, in sorted order, with ``[size, version]``: the modification time, or what the store lists
    (ETag, else modification time), so that a rewritten file changes its entry.

    Raises:
        FileNotFoundError: ``folder`` does not exist (a URL: no file below it).
    """
    if is_url(folder):
        found = listing(str(folder))
        return {name: [info.get("size"), str(info.get("ETag") or info.get("LastModified") or info.get("mtime"))]
                for name, info in sorted(found.items())}
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder" if folder.exists() else f"folder {folder} does not exist")
    found = {}
    for path in folder.rglob("*"):
        if not path.is_dir():
            stat = path.stat() if path.exists() else path.lstat()
            found[path.relative_to(folder).as_posix()] = [stat.st_size, stat.st_mtime_ns]
    return dict(sorted(found.items()))


def download(folder: str, target: Path) -> Path:
    """Copies every file below the URL ``folder`` into the local folder ``target``, which appears whole or not at
    all (:func:`~vip_core.atomic.atomic_path`); a ``target`` already there is kept as it is. Returns ``target``.

    Raises:
        FileNotFoundError: no file below ``folder``.
    """
    if target.is_dir():
        return target
    fs, inner = _existing_folder(folder)
    with atomic_path(target) as partial:
        partial.mkdir()
        fs.get(f"{inner}/", f"{partial}/", recursive=True)
    return target


def name(path: Location) -> str:
    """The file name: the last part of the path or URL."""
    return str(path).rstrip("/").rpartition("/")[2]


def _existing_folder(url: str):
    """The file system and the folder's path in it (no trailing ``/``), listed afresh; one line if it has no file."""
    fs, inner = _filesystem(url)
    inner = inner.rstrip("/")
    fs.invalidate_cache(inner)
    if not fs.isdir(inner):
        raise FileNotFoundError(f"folder not found: {url}")
    return fs, inner


def _filesystem(url: Location):
    import fsspec

    return fsspec.core.url_to_fs(str(url))
