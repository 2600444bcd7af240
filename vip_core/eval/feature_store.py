"""Frozen-encoder features on disk, written once and read back a batch at a time: the linear probe in bounded memory.

With the paper's protocol (12 blocks x 768 features of 1.28 M ImageNet images) the probe's training features are
23.6 GB in bfloat16, 47 GB in float32: more than a worker's memory. So each worker runs the frozen encoder once
over its block of a split (:func:`write_features`) and writes its rows to a shard of its own in the job's folder,
``<split>-<rank>-of-<world>.bin`` (bfloat16 rows of ``dim`` values) beside its labels (``.labels.npy``) and, last, a
small ``.json`` saying the shard is whole. The probe then reads any rows it needs (:class:`StoredFeatures`), from
every shard: its memory does not grow with the number of images (the labels stay in memory, 8 bytes an image).
A shard already whole from an earlier start is kept. The folder must be one every worker reaches (on several
machines, a shared file system).

bfloat16 keeps float32's range (a feature never overflows) with 8 bits of precision, below what a linear head
trained by SGD resolves; :func:`stored_rounding` is that rounding.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from vip_core.atomic import atomic_path, write_json
from vip_core.eval.features import feature_batches
from vip_core.eval.loading import Loading, rank_block
from vip_core.train.distributed import barrier, rank_and_world

logger = logging.getLogger(__name__)

STORED_DTYPE = torch.bfloat16
_BYTES = 2  # per stored value


class Features(Protocol):
    """Rows of features and their labels, read by index: in memory or on disk."""

    labels: torch.Tensor  # [N]

    @property
    def dim(self) -> int: ...

    def __len__(self) -> int: ...

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """``[b, dim]`` features of ``indices: [b]`` (in the dtype they are kept in: convert on the device)."""


class InMemoryFeatures:
    """``features: [N, F]`` and ``labels: [N]`` held in memory (small sets, tests)."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.features, self.labels = features, labels

    @property
    def dim(self) -> int:
        return self.features.shape[1]

    def __len__(self) -> int:
        return len(self.labels)

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        return self.features[indices]  # [b, F]


def stored_rounding(features: torch.Tensor) -> torch.Tensor:
    """``features`` as the store keeps them (rounded to bfloat16), back in float32."""
    return features.to(STORED_DTYPE).float()


class StoredFeatures:
    """A split's feature shards in ``folder``, read a batch of rows at a time."""

    def __init__(self, folder: str | Path, split: str) -> None:
        self.folder = Path(folder)
        metas = sorted(self.folder.glob(f"{split}-*-of-*.json"))
        if not metas:
            raise FileNotFoundError(f"no feature shards of the {split} split in {self.folder}")
        shards = [json.loads(meta.read_text()) for meta in metas]
        self._dim = shards[0]["dim"]
        self.files = [self.folder / shard["file"] for shard in shards]
        counts = np.array([shard["rows"] for shard in shards])
        self._starts = np.cumsum(counts) - counts  # [S]: each shard's first global row
        self.labels = torch.cat([torch.from_numpy(np.load(self.folder / shard["labels"])) for shard in shards])
        self._handles: list[int] | None = None

    @property
    def dim(self) -> int:
        return self._dim

    def __len__(self) -> int:
        return len(self.labels)

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Bfloat16 ``[b, dim]`` rows ``indices: [b]``, read from their shards (runs of consecutive rows at once)."""
        handles = self._open()
        order = np.argsort(indices.numpy(), kind="stable")
        wanted = indices.numpy()[order]  # [b], ascending
        shards = np.searchsorted(self._starts, wanted, side="right") - 1  # [b]
        breaks = np.flatnonzero((np.diff(wanted) != 1) | (np.diff(shards) != 0)) + 1
        rows = np.empty((len(wanted), self.dim), dtype=np.int16)  # [b, dim] bfloat16 bits, ascending
        row_bytes = self.dim * _BYTES
        for start, stop in zip([0, *breaks], [*breaks, len(wanted)]):
            shard = shards[start]
            offset = int(wanted[start] - self._starts[shard]) * row_bytes
            read = os.preadv(handles[shard], [memoryview(rows[start:stop])], offset)
            if read != (stop - start) * row_bytes:
                raise ValueError(f"feature shard {self.files[shard]} is shorter than its rows: written by another run?")
        unsorted = np.empty_like(rows)
        unsorted[order] = rows
        return torch.from_numpy(unsorted).view(STORED_DTYPE)  # [b, dim]

    def _open(self) -> list[int]:
        if self._handles is None:
            self._handles = [os.open(file, os.O_RDONLY) for file in self.files]
        return self._handles

    def close(self) -> None:
        for handle in self._handles or []:
            os.close(handle)
        self._handles = None

    def __del__(self) -> None:
        self.close()


def write_features(encoder: nn.Module, dataset: Dataset, folder: str | Path, split: str, *, last_blocks: int,
                   batch_size: int, loading: Loading, precision: str = "fp32") -> StoredFeatures:
    """Writes this worker's shard of ``split``'s features (its block of ``dataset``) into ``folder``, unless it
    is there whole already; waits for every worker's; returns the split's :class:`StoredFeatures`."""
    rank, world = rank_and_world()
    folder = Path(folder)
    name = f"{split}-{rank:05d}-of-{world:05d}"
    block = rank_block(dataset)
    if not (folder / f"{name}.json").is_file():
        _write_shard(encoder, block, folder, name, last_blocks=last_blocks, batch_size=batch_size, loading=loading,
                     precision=precision)
    else:
        logger.info("features of %s already in %s", name, folder)
    barrier()
    return StoredFeatures(folder, split)


def _write_shard(encoder: nn.Module, block: Dataset, folder: Path, name: str, **options) -> None:
    """The rows of ``block`` streamed into ``name.bin``, then its labels, then the ``name.json`` that marks it whole."""
    dim, labels = None, []
    with atomic_path(folder / f"{name}.bin") as partial, open(partial, "wb") as out:
        for features, targets in feature_batches(encoder, block, **options):  # features: [b, F]
            dim = features.shape[1]
            out.write(features.to(STORED_DTYPE).view(torch.int16).numpy().tobytes())
            labels.append(targets)
    stacked = torch.cat(labels).numpy().astype(np.int64)  # [n]
    with atomic_path(folder / f"{name}.labels.npy") as partial, open(partial, "wb") as out:
        np.save(out, stacked)
    write_json(folder / f"{name}.json", {"file": f"{name}.bin", "labels": f"{name}.labels.npy", "rows": len(stacked),
                                         "dim": dim, "dtype": str(STORED_DTYPE)})
    logger.info("wrote the features of %d images to %s", len(stacked), folder / f"{name}.bin")
