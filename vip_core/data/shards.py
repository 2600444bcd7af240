"""Webdataset-format tar shards: write them atomically, list them, read them back.

A shard is ``{prefix}-{index:06d}.tar``; a sample is the tar members sharing a key
(``000123.jpg``, ``000123.json``), as webdataset and img2dataset write them. A shard is written to a
temporary name and renamed when complete, so a killed writer leaves no half shard behind, and a
writer opened again on the same folder continues after the last complete shard.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from PIL import Image

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
_PARTIAL_SUFFIX = ".partial"


def list_shards(folder: str | Path, prefix: str = "") -> list[Path]:
    """The complete shards in ``folder`` (optionally only those named ``{prefix}-*``), in order."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"shard folder {folder} does not exist")
    pattern = f"{prefix}-*.tar" if prefix else "*.tar"
    return sorted(folder.glob(pattern))


def iter_samples(shards: Iterable[str | Path]) -> Iterator[dict[str, Any]]:
    """Samples as dicts: ``{"__key__": key, "__shard__": path, "jpg": bytes, "json": dict, ...}``."""
    for shard in shards:
        yield from _iter_shard(Path(shard))


def _iter_shard(shard: Path) -> Iterator[dict[str, Any]]:
    current: dict[str, Any] | None = None
    with tarfile.open(shard, "r") as archive:
        for member in archive:
            if not member.isfile():
                continue
            key, _, extension = member.name.rpartition("/")[2].partition(".")
            if current is not None and current["__key__"] != key:
                yield current
                current = None
            if current is None:
                current = {"__key__": key, "__shard__": str(shard)}
            payload = archive.extractfile(member).read()  # type: ignore[union-attr]
            current[extension] = json.loads(payload) if extension == "json" else payload
    if current is not None:
        yield current


def count_samples(shards: Iterable[str | Path]) -> int:
    """The number of samples with an image in ``shards``, reading only the tar headers."""
    total = 0
    for shard in shards:
        with tarfile.open(shard, "r") as archive:
            total += sum(
                1 for member in archive if member.isfile() and member.name.rpartition(".")[2] in IMAGE_EXTENSIONS
            )
    return total


def sample_image(sample: dict[str, Any]) -> Image.Image:
    """The sample's image, decoded to RGB."""
    for extension in IMAGE_EXTENSIONS:
        if extension in sample:
            with Image.open(io.BytesIO(sample[extension])) as image:
                return image.convert("RGB")
    raise ValueError(f"sample {sample.get('__key__')!r} in {sample.get('__shard__')} has no image")


def encode_image(image: Image.Image, fmt: str = "jpg", quality: int = 95) -> bytes:
    """An RGB image as jpg or png bytes."""
    buffer = io.BytesIO()
    if fmt == "png":
        image.save(buffer, format="PNG")
    else:
        image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


class ShardWriter:
    """Writes samples into numbered shards of at most ``samples_per_shard`` samples each.

    Use as a context manager. Each shard becomes visible (renamed from ``*.partial``) only once full or
    when the writer closes, so readers and resumed writers never see half a shard.
    """

    def __init__(self, folder: str | Path, prefix: str = "shard", samples_per_shard: int = 1000) -> None:
        if samples_per_shard <= 0:
            raise ValueError(f"samples_per_shard must be positive, got {samples_per_shard}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.samples_per_shard = samples_per_shard
        for stale in self.folder.glob(f"{prefix}-*.tar{_PARTIAL_SUFFIX}"):
            stale.unlink()
        done = list_shards(self.folder, prefix)
        self.next_index = int(done[-1].stem.rpartition("-")[2]) + 1 if done else 0
        self.written: list[Path] = []
        self._archive: tarfile.TarFile | None = None
        self._in_shard = 0

    def write(self, key: str, fields: dict[str, Any]) -> None:
        """Adds one sample: ``fields`` maps an extension to bytes, str, or a JSON-able dict."""
        if "." in key or "/" in key:
            raise ValueError(f"sample key {key!r} must not contain '.' or '/'")
        if self._archive is None:
            self._open_next()
        for extension, value in fields.items():
            self._add_member(f"{key}.{extension}", _as_bytes(value))
        self._in_shard += 1
        if self._in_shard >= self.samples_per_shard:
            self._close_current()

    def close(self) -> list[Path]:
        """Finishes the open shard; returns the shards this writer completed."""
        self._close_current()
        return self.written

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open_next(self) -> None:
        self._final_path = self.folder / f"{self.prefix}-{self.next_index:06d}.tar"
        self._partial_path = self._final_path.with_name(self._final_path.name + _PARTIAL_SUFFIX)
        self._archive = tarfile.open(self._partial_path, "w")
        self._in_shard = 0
        self.next_index += 1

    def _add_member(self, name: str, payload: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(payload)
        info.mode = 0o644
        self._archive.addfile(info, io.BytesIO(payload))  # type: ignore[union-attr]

    def _close_current(self) -> None:
        if self._archive is None:
            return
        self._archive.close()
        self._archive = None
        self._partial_path.replace(self._final_path)
        self.written.append(self._final_path)


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return json.dumps(value, sort_keys=True).encode()
