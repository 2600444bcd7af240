"""Training data from shards: an index of where each image is, per-worker partitions, per-worker random
streams, and decoding to ``[3, H, W]`` tensors at the model's image size.

Shards are webdataset tars (``*.tar``, as ``ShardWriter`` and img2dataset write them) or, in a folder
without tars, parquet files (``*.parquet``, img2dataset's parquet output) with an image column (``jpg``,
``png``, ``webp`` or ``image``, bytes); rows whose image is null are skipped. The folder is a local path or
any fsspec URL (``s3://bucket/shards``: :mod:`vip_core.data.storage`).

Partition. The samples of all shards, in shard order, get global indices ``0 .. N-1``; worker ``r`` of
``W`` owns the contiguous block ``[r*N//W, (r+1)*N//W)``, so it reads only the shards that block touches
(its shard list). The blocks are disjoint and cover the data set, so when every worker Poisson-samples
each of its own samples with probability q, the union over workers is a Poisson sample of the whole
data set at rate q: the sampling the accountant is fed.

The data set's fingerprint (:func:`measure_shards`: shard names and sizes and where each image lies) names
its privacy ledger and ties a resumed run to the data it started on.

Damaged images. An image whose bytes do not decode whole (truncated, not an image, a decompression bomb) is
*skipped*: :meth:`ShardPartition.decode` returns it as zeros marked not ``usable``, and the training step's batch
leaves it out of the sample it hands the private step, so it contributes nothing to the clipped sum (as a
sample whose gradient is zero would), while the Poisson sampling, the expected batch size the sum is divided by
and the noise stay as planned (the accountant's q is unchanged). A shard that cannot be read at all is an error
naming it. ``vip shards --check DIR`` lists the damaged images of a folder before a run.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np
import torch
from PIL import Image

from vip_core.data import storage
from vip_core.data.shards import IMAGE_EXTENSIONS
from vip_core.data.storage import Location

# What decoding bytes that are not a whole image raises: truncated or corrupt data, an unknown format, a bomb, and
# whatever else PIL's format plugins raise on crafted headers (a DDS pixel format 0 raises NotImplementedError). The
# data's author chooses the bytes, and a stage that fails on them would tell that the image was sampled.
DAMAGED_IMAGE_ERRORS = (Exception,)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# ---------------------------------------------------------------------------------------------- partition


def partition_range(dataset_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The global indices ``[start, stop)`` worker ``rank`` of ``world_size`` owns."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size} workers")
    if dataset_size < world_size:
        raise ValueError(f"{dataset_size} samples cannot be shared among {world_size} workers")
    return rank * dataset_size // world_size, (rank + 1) * dataset_size // world_size


def shards_for_range(counts: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """The shards that global samples ``[start, stop)`` lie in, as ``(shard, first, stop)`` local ranges.

    Args:
        counts: samples per shard, in shard order.
        start: first global index.
        stop: one past the last global index.
    """
    pieces = []
    shard_start = 0
    for shard, count in enumerate(counts):
        shard_stop = shard_start + count
        lo, hi = max(start, shard_start), min(stop, shard_stop)
        if lo < hi:
            pieces.append((shard, lo - shard_start, hi - shard_start))
        shard_start = shard_stop
    return pieces


# ------------------------------------------------------------------------------------------------ the index


PARQUET_IMAGE_COLUMNS = ("jpg", "png", "webp", "image")


@dataclass(frozen=True)
class TarLocation:
    """Where one image's bytes are in a tar shard: the file, a byte offset and a length."""

    shard: Location
    offset: int
    size: int


@dataclass(frozen=True)
class ParquetLocation:
    """Where one image is in a parquet shard: the file, a row group, a row in it and the image column."""

    shard: Location
    row_group: int
    row: int
    column: str


def image_locations(shard: Location) -> list[TarLocation] | list[ParquetLocation]:
    """The images of one shard (a local path or URL), in order: a tar's or a parquet file's."""
    shard = storage.as_location(shard)
    if str(shard).endswith(".parquet"):
        return parquet_locations(shard)
    return tar_locations(shard)


def tar_locations(shard: Location) -> list[TarLocation]:
    """The image members of a tar shard, one per sample (the first image of each key), in tar order.

    Reads only the tar headers.

    Raises:
        ValueError: the shard is not a readable tar (cut short, or not a tar), naming it.
    """
    with storage.open_binary(shard) as handle, _open_tar(shard, handle) as archive:
        return [TarLocation(shard, member.offset_data, member.size) for member in _image_members(archive)]


@contextlib.contextmanager
def _open_tar(shard: Location, handle) -> Iterator[tarfile.TarFile]:
    try:
        with tarfile.open(fileobj=handle, mode="r") as archive:
            yield archive
    except tarfile.TarError as error:
        raise ValueError(f"shard {shard} is not a readable tar: {error}") from None


def _image_members(archive: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The image members of an open tar, one per sample (the first image of each key), in tar order."""
    seen_keys: set[str] = set()
    for member in archive:
        key, _, extension = member.name.rpartition("/")[2].partition(".")
        if member.isfile() and extension in IMAGE_EXTENSIONS and key not in seen_keys:
            seen_keys.add(key)
            yield member


def parquet_locations(shard: Location) -> list[ParquetLocation]:
    """The non-null images of a parquet shard, reading the image column only for row groups with nulls."""
    import pyarrow.parquet as pq

    with storage.open_binary(shard) as handle:
        return _parquet_locations(shard, pq.ParquetFile(handle))


def _parquet_locations(shard: Location, parquet) -> list[ParquetLocation]:
    names = parquet.schema_arrow.names
    column = next((name for name in PARQUET_IMAGE_COLUMNS if name in names), None)
    if column is None:
        raise ValueError(f"{shard} has no image column (one of {', '.join(PARQUET_IMAGE_COLUMNS)}; found {names})")
    column_index = names.index(column)
    locations = []
    for group in range(parquet.num_row_groups):
        metadata = parquet.metadata.row_group(group)
        statistics = metadata.column(column_index).statistics
        if statistics is not None and statistics.has_null_count and statistics.null_count == 0:
            rows = range(metadata.num_rows)
        else:
            valid = parquet.read_row_group(group, columns=[column]).column(0).is_valid().to_pylist()
            rows = [row for row, ok in enumerate(valid) if ok]
        locations.extend(ParquetLocation(shard, group, row, column) for row in rows)
    return locations


class ShardSet(NamedTuple):
    """A measured shard-backed data set.

    Attributes:
        shards: the complete shards, in order.
        counts: the number of images in each (the measured N is the sum).
        fingerprint: a digest of every shard's size, of where each image lies in it (offset and length in a
            tar, row group and row in a parquet file) and of the shard's first and last 64 KiB, in order (not
            of the shards' names or paths: renamed or moved shards are the same data set): it names the data
            set's privacy ledger and ties a resumed run to its data.
    """

    shards: list[Location]
    counts: list[int]
    fingerprint: str


def measure_shards(folder: Location) -> ShardSet:
    """The shards of ``folder`` (a local path or URL: complete tars, else parquet files), their image counts
    and fingerprint, in one pass over the shards' headers."""
    shards = storage.glob(folder, "*.tar") or storage.glob(folder, "*.parquet")
    if not shards:
        raise FileNotFoundError(f"no shards (*.tar or *.parquet) in {folder}")
    digest = hashlib.sha256()
    counts = []
    for shard in shards:
        locations = image_locations(shard)
        counts.append(len(locations))
        digest.update(json.dumps([storage.file_size(shard), [_layout(loc) for loc in locations]]).encode())
        digest.update(_ends(shard))
    return ShardSet(shards, counts, digest.hexdigest()[:32])


def _ends(shard: Location, size: int = 64 * 1024) -> bytes:
    """The first and last ``size`` bytes of a file (all of it when it is smaller than twice that)."""
    with storage.open_binary(shard) as handle:
        head = handle.read(size)
        handle.seek(max(handle.seek(0, io.SEEK_END) - size, len(head)))
        return head + handle.read()


def _layout(location: TarLocation | ParquetLocation) -> tuple[int, int]:
    if isinstance(location, TarLocation):
        return location.offset, location.size
    return location.row_group, location.row


def decode_pixels(payload: bytes, img_size: int) -> torch.Tensor:
    """Image bytes to ``[3, img_size, img_size]`` uint8 RGB, resized bicubically.

    A JPEG is decoded at the smallest DCT scale (1/2, 1/4, 1/8) that still covers ``img_size`` on both sides
    (PIL's ``draft``), so a 256 px JPEG for a 64 px model decodes a quarter of the way; other formats decode
    whole.
    """
    with Image.open(io.BytesIO(payload)) as image:
        image.draft("RGB", (img_size, img_size))
        rgb = image.convert("RGB")
    if rgb.size != (img_size, img_size):
        rgb = rgb.resize((img_size, img_size), Image.BICUBIC)
    pixels = torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy())  # pixels: [H, W, 3]
    return pixels.permute(2, 0, 1).contiguous()  # [3, H, W]


class Decoded(NamedTuple):
    """Decoded images: ``pixels`` ``[k, 3, H, W]`` uint8 (zeros where damaged) and ``usable`` ``[k]`` bool."""

    pixels: torch.Tensor
    usable: torch.Tensor


def decode_usable(payloads: Sequence[bytes], img_size: int) -> Decoded:
    """Image bytes to :class:`Decoded`: each decoded by :func:`decode_pixels`, a damaged one as zeros, not usable."""
    pixels = torch.zeros(len(payloads), 3, img_size, img_size, dtype=torch.uint8)  # [k, 3, H, W]
    usable = torch.zeros(len(payloads), dtype=torch.bool)  # [k]
    for position, payload in enumerate(payloads):
        try:
            pixels[position] = decode_pixels(payload, img_size)
        except DAMAGED_IMAGE_ERRORS:
            continue
        usable[position] = True
    return Decoded(pixels, usable)


def check_shard(shard: Location, img_size: int) -> dict[str, Any]:
    """Decodes every image of one shard as training does (:func:`decode_pixels` at ``img_size``).

    Returns:
        ``{"shard", "images", "damaged": [{"member", "error"}]}`` (a tar member's name, or a parquet shard's
        ``row group G row R``), or ``{"shard", "error"}`` when the shard itself cannot be read.
    """
    damaged, images = [], 0
    try:
        for member, payload in _image_payloads(shard):
            images += 1
            try:
                decode_pixels(payload, img_size)
            except DAMAGED_IMAGE_ERRORS as error:
                damaged.append({"member": member, "error": _first_line(error)})
    except (OSError, ValueError) as error:
        return {"shard": str(shard), "error": _first_line(error)}
    return {"shard": str(shard), "images": images, "damaged": damaged}


def _image_payloads(shard: Location) -> Iterator[tuple[str, bytes]]:
    """``(member name, bytes)`` of each image of a tar or parquet shard, in order."""
    shard = storage.as_location(shard)
    if str(shard).endswith(".parquet"):
        locations = parquet_locations(shard)
        payloads: list = [None] * len(locations)
        for group in sorted({location.row_group for location in locations}):
            positions = [i for i, location in enumerate(locations) if location.row_group == group]
            _read_parquet(shard, group, locations, positions, payloads)
        yield from ((f"row group {loc.row_group} row {loc.row}", payload) for loc, payload in zip(locations, payloads))
        return
    with storage.open_binary(shard) as handle, _open_tar(shard, handle) as archive:
        for member in _image_members(archive):
            yield member.name, archive.extractfile(member).read()  # type: ignore[union-attr]


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def normalise(pixels: torch.Tensor) -> torch.Tensor:
    """RGB ``[B, 3, H, W]`` in 0..255 (uint8, or float after augmentation) to float32 with ImageNet statistics,
    on the pixels' device; ``pixels`` is left as it is."""
    mean = torch.tensor(IMAGENET_MEAN, device=pixels.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=pixels.device).view(1, 3, 1, 1)
    return (pixels.to(torch.float32, copy=True).div_(255.0) - mean) / std  # [B, 3, H, W]


def decode_image(payload: bytes, img_size: int) -> torch.Tensor:
    """Image bytes to a normalised ``[3, img_size, img_size]`` float tensor (resized, ImageNet statistics)."""
    return normalise(decode_pixels(payload, img_size).unsqueeze(0))[0]  # [3, H, W]


class ShardPartition:
    """One worker's block of the shard-backed data set: its images, decoded on demand.

    Args:
        shards: all complete shards, in order.
        counts: images per shard (from :func:`measure_shards`).
        rank: this worker's global rank.
        world_size: the number of workers.
        img_size: side of the square tensors returned.
    """

    def __init__(self, shards: Sequence[Location], counts: Sequence[int], rank: int, world_size: int, img_size: int) -> None:
        if len(shards) != len(counts):
            raise ValueError(f"{len(shards)} shards but {len(counts)} counts")
        self.dataset_size = int(sum(counts))
        self.start, self.stop = partition_range(self.dataset_size, rank, world_size)
        self.img_size = img_size
        self.locations: list[TarLocation | ParquetLocation] = []
        for shard, first, stop in shards_for_range(counts, self.start, self.stop):
            found = image_locations(shards[shard])
            if len(found) != counts[shard]:
                raise ValueError(f"shard {shards[shard]} holds {len(found)} images, expected {counts[shard]}")
            self.locations.extend(found[first:stop])

    def __len__(self) -> int:
        return len(self.locations)

    @property
    def shard_files(self) -> list[Location]:
        """The shards this worker reads."""
        return sorted({location.shard for location in self.locations}, key=str)

    def global_indices(self, local: torch.Tensor) -> torch.Tensor:
        """Local indices ``[B]`` to global sample indices ``[B]``."""
        return local + self.start

    def images(self, local: torch.Tensor) -> torch.Tensor:
        """The images at local indices ``[B]``, normalised, as ``[B, 3, H, W]`` float32 (zeros where damaged)."""
        return normalise(self.decode(local).pixels)  # [B, 3, H, W]

    def decode(self, local: torch.Tensor) -> Decoded:
        """The images at local indices ``[B]``: ``[B, 3, H, W]`` uint8 RGB and whether each is usable (a damaged
        one is zeros, not usable)."""
        return decode_usable(self._read([self.locations[i] for i in local.tolist()]), self.img_size)

    def _read(self, wanted: list[TarLocation | ParquetLocation]) -> list[bytes]:
        """The bytes of ``wanted``, opening each shard (each parquet row group) once."""
        payloads: list[bytes | None] = [None] * len(wanted)
        by_source: dict[tuple[Location, int], list[int]] = {}
        for position, location in enumerate(wanted):
            group = location.row_group if isinstance(location, ParquetLocation) else -1
            by_source.setdefault((location.shard, group), []).append(position)
        for (shard, group), positions in by_source.items():
            if group < 0:
                _read_tar(shard, wanted, positions, payloads)
            else:
                _read_parquet(shard, group, wanted, positions, payloads)
        return payloads  # type: ignore[return-value]


def _read_tar(shard: Location, wanted: list, positions: list[int], payloads: list) -> None:
    with storage.open_binary(shard) as handle:
        for position in positions:
            handle.seek(wanted[position].offset)
            payloads[position] = handle.read(wanted[position].size)


def _read_parquet(shard: Location, group: int, wanted: list, positions: list[int], payloads: list) -> None:
    import pyarrow.parquet as pq

    column = wanted[positions[0]].column
    with storage.open_binary(shard) as handle:
        images = pq.ParquetFile(handle).read_row_group(group, columns=[column]).column(0)
    for position in positions:
        payloads[position] = images[wanted[position].row].as_py()


def microbatches(local: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """Consecutive chunks of at most ``size`` indices from ``local`` ``[B]``."""
    if size <= 0:
        raise ValueError(f"microbatch size must be positive, got {size}")
    yield from torch.split(local, size)
