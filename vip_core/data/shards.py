"""Webdataset-format tar shards: write them atomically, list them, read them back.

A shard is ``{prefix}-{index:06d}.tar``; a sample is the tar members sharing a key
(``000123.jpg``, ``000123.json``), as webdataset and img2dataset write them. A shard is written whole
(:func:`write_shard`, through :mod:`vip_core.atomic`), so a killed writer leaves no half shard behind,
and a writer opened again on the same folder continues after the last complete shard.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from PIL import Image

from vip_core.atomic import atomic_path, remove_partials

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
Sample = tuple[str, dict[str, Any]]


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


def write_shard(path: str | Path, samples: Iterable[Sample]) -> Path:
    """Writes one whole shard: ``samples`` are ``(key, fields)``, ``fields`` mapping an extension to bytes, str
    or a JSON-able dict. No sample at all gives an empty tar (a shard that is done but holds nothing)."""
    with atomic_path(path) as partial, tarfile.open(partial, "w") as archive:
        for key, fields in samples:
            _check_key(key)
            for extension, value in fields.items():
                payload = _as_bytes(value)
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size = len(payload)
                info.mode = 0o644
                archive.addfile(info, io.BytesIO(payload))
    return Path(path)


class ShardWriter:
    """Writes samples into numbered shards of at most ``samples_per_shard`` samples each.

    Use as a context manager. A shard is held in memory until full (or the writer closes), then written
    whole with :func:`write_shard`, so readers and resumed writers never see half a shard.
    """

    def __init__(self, folder: str | Path, prefix: str = "shard", samples_per_shard: int = 1000) -> None:
        if samples_per_shard <= 0:
            raise ValueError(f"samples_per_shard must be positive, got {samples_per_shard}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.samples_per_shard = samples_per_shard
        remove_partials(self.folder, f"{prefix}-")
        done = list_shards(self.folder, prefix)
        self.next_index = int(done[-1].stem.rpartition("-")[2]) + 1 if done else 0
        self.written: list[Path] = []
        self._pending: list[Sample] = []

    def write(self, key: str, fields: dict[str, Any]) -> None:
        """Adds one sample: ``fields`` maps an extension to bytes, str, or a JSON-able dict."""
        _check_key(key)
        self._pending.append((key, fields))
        if len(self._pending) >= self.samples_per_shard:
            self._flush()

    def close(self) -> list[Path]:
        """Finishes the open shard; returns the shards this writer completed."""
        self._flush()
        return self.written

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _flush(self) -> None:
        if not self._pending:
            return
        path = self.folder / f"{self.prefix}-{self.next_index:06d}.tar"
        self.written.append(write_shard(path, self._pending))
        self._pending = []
        self.next_index += 1


def _check_key(key: str) -> None:
    if "." in key or "/" in key:
        raise ValueError(f"sample key {key!r} must not contain '.' or '/'")


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return json.dumps(value, sort_keys=True, default=str).encode()
