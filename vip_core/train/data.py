"""Training data from webdataset tar shards: an index of where each image is, per-worker partitions,
per-worker random streams, and decoding to ``[3, H, W]`` tensors at the model's image size.

Partition. The samples of all shards, in shard order, get global indices ``0 .. N-1``; worker ``r`` of
``W`` owns the contiguous block ``[r*N//W, (r+1)*N//W)``, so it reads only the shards that block touches
(its shard list). The blocks are disjoint and cover the data set, so when every worker Poisson-samples
each of its own samples with probability q, the union over workers is a Poisson sample of the whole
data set at rate q: the sampling the accountant is fed.

Random streams. :func:`stream_generator` derives a torch generator from ``(entropy, rank, purpose)``
through numpy's ``SeedSequence``: streams of different ranks or purposes are statistically independent,
never the same seed reused (the ViP paper's released script seeds every rank alike, which correlates
the ranks' samples).
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from PIL import Image

from vip_core.data.shards import IMAGE_EXTENSIONS, list_shards

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
STREAM_PURPOSES = ("sampling", "masking", "noise")


# ------------------------------------------------------------------------------------------------ streams


def stream_generator(entropy: int, rank: int, purpose: str) -> torch.Generator:
    """A CPU generator for ``purpose`` on ``rank``, independent of every other (rank, purpose) pair.

    Args:
        entropy: the run's root entropy (a fresh random number for a private run).
        rank: the worker's global rank.
        purpose: one of ``STREAM_PURPOSES``.
    """
    if purpose not in STREAM_PURPOSES:
        raise ValueError(f"unknown random stream {purpose!r} (known: {', '.join(STREAM_PURPOSES)})")
    sequence = np.random.SeedSequence(entropy, spawn_key=(rank, STREAM_PURPOSES.index(purpose)))
    seed = int(sequence.generate_state(1, dtype=np.uint64)[0]) & ((1 << 63) - 1)
    return torch.Generator().manual_seed(seed)


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


@dataclass(frozen=True)
class ImageLocation:
    """Where one image's bytes are: a shard file, a byte offset and a length."""

    shard: Path
    offset: int
    size: int


def image_locations(shard: str | Path) -> list[ImageLocation]:
    """The image members of one shard, one per sample (the first image of each key), in tar order.

    Reads only the tar headers.
    """
    shard = Path(shard)
    locations = []
    seen_keys: set[str] = set()
    with tarfile.open(shard, "r") as archive:
        for member in archive:
            key, _, extension = member.name.rpartition("/")[2].partition(".")
            if member.isfile() and extension in IMAGE_EXTENSIONS and key not in seen_keys:
                seen_keys.add(key)
                locations.append(ImageLocation(shard, member.offset_data, member.size))
    return locations


def shard_counts(folder: str | Path) -> tuple[list[Path], list[int]]:
    """The complete shards of ``folder`` and the number of images in each (the measured N is the sum)."""
    shards = list_shards(folder)
    if not shards:
        raise FileNotFoundError(f"no shards (*.tar) in {folder}")
    return shards, [len(image_locations(shard)) for shard in shards]


def decode_image(payload: bytes, img_size: int) -> torch.Tensor:
    """Image bytes to a normalised ``[3, img_size, img_size]`` float tensor (resized, ImageNet statistics)."""
    with Image.open(io.BytesIO(payload)) as image:
        rgb = image.convert("RGB")
    if rgb.size != (img_size, img_size):
        rgb = rgb.resize((img_size, img_size), Image.BICUBIC)
    pixels = torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy())  # pixels: [H, W, 3]
    x = pixels.permute(2, 0, 1).float().div_(255.0)  # x: [3, H, W]
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (x - mean) / std


class ShardPartition:
    """One worker's block of the shard-backed data set: its images, decoded on demand.

    Args:
        shards: all complete shards, in order.
        counts: images per shard (from :func:`shard_counts`).
        rank: this worker's global rank.
        world_size: the number of workers.
        img_size: side of the square tensors returned.
    """

    def __init__(self, shards: Sequence[str | Path], counts: Sequence[int], rank: int, world_size: int, img_size: int) -> None:
        if len(shards) != len(counts):
            raise ValueError(f"{len(shards)} shards but {len(counts)} counts")
        self.dataset_size = int(sum(counts))
        self.start, self.stop = partition_range(self.dataset_size, rank, world_size)
        self.img_size = img_size
        self.locations: list[ImageLocation] = []
        for shard, first, stop in shards_for_range(counts, self.start, self.stop):
            found = image_locations(shards[shard])
            if len(found) != counts[shard]:
                raise ValueError(f"shard {shards[shard]} holds {len(found)} images, expected {counts[shard]}")
            self.locations.extend(found[first:stop])

    def __len__(self) -> int:
        return len(self.locations)

    @property
    def shard_files(self) -> list[Path]:
        """The shards this worker reads."""
        return sorted({location.shard for location in self.locations})

    def global_indices(self, local: torch.Tensor) -> torch.Tensor:
        """Local indices ``[B]`` to global sample indices ``[B]``."""
        return local + self.start

    def images(self, local: torch.Tensor) -> torch.Tensor:
        """The images at local indices ``[B]``, as ``[B, 3, H, W]``."""
        if local.numel() == 0:
            return torch.empty(0, 3, self.img_size, self.img_size)
        payloads = self._read([self.locations[i] for i in local.tolist()])
        return torch.stack([decode_image(payload, self.img_size) for payload in payloads])  # [B, 3, H, W]

    def _read(self, wanted: list[ImageLocation]) -> list[bytes]:
        """The bytes of ``wanted``, opening each shard once."""
        payloads: list[bytes | None] = [None] * len(wanted)
        by_shard: dict[Path, list[int]] = {}
        for position, location in enumerate(wanted):
            by_shard.setdefault(location.shard, []).append(position)
        for shard, positions in by_shard.items():
            with open(shard, "rb") as handle:
                for position in positions:
                    handle.seek(wanted[position].offset)
                    payloads[position] = handle.read(wanted[position].size)
        return payloads  # type: ignore[return-value]


def microbatches(local: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """Consecutive chunks of at most ``size`` indices from ``local`` ``[B]``."""
    if size <= 0:
        raise ValueError(f"microbatch size must be positive, got {size}")
    yield from torch.split(local, size)
