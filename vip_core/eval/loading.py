"""How an evaluation job reads its data: on which device, with how many decoding processes, and which part of every
batch each worker takes.

A job runs in one process or as one of ``W`` data-parallel workers (a Ray Train job, a torch.distributed process
group). Either way it reads through :class:`Loading` and :class:`EpochBatches`:

* :class:`EpochBatches` deals every epoch's global batches out to the workers: the epoch's order (a permutation
  keyed by the job's seed and the epoch, or the data's own order) is cut into global batches of ``batch_size``
  (fewer than ``W`` images in the last one: it is dropped), and worker ``r`` takes the ``r``-th of ``W`` equal
  parts of each. Every worker takes the same number of steps, each on an equal share, so averaging the workers'
  gradients gives the gradient of the global batch's mean loss, as one process would. It yields each image as the
  key ``(index, epoch)``: the data sets key an image's augmentation by it (:mod:`vip_core.eval.datasets`), so the
  draws do not depend on the decoding processes, on the workers or on where a resumed run restarted.
* :func:`rank_block` gives evaluation its worker's contiguous block of a held-out split; the scores are summed
  over workers.
* :class:`Loading` makes the ``DataLoader``: ``workers`` decoding processes (``evaluation.loader_workers``), pinned
  memory when the device is a GPU, and a fixed generator (:mod:`vip_core.eval.seeding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from vip_core.eval.seeding import generator
from vip_core.train.data import normalise, partition_range
from vip_core.train.distributed import rank_and_world

Key = tuple[int, int]
"""``(index, epoch)``: an image of a data set as one epoch reads it."""


def resolve_device(device: str) -> torch.device:
    """``evaluation.device`` as a torch device: ``auto`` is CUDA when a device is there, else the CPU.

    Raises:
        ValueError: ``cuda`` without a CUDA device.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("evaluation.device: cuda, but torch finds no CUDA device here (use auto or cpu)")
    return torch.device(device)


def worker_device(device: torch.device) -> torch.device:
    """The device of this worker: its own GPU (``LOCAL_RANK``, as Ray Train and torchrun set it) on CUDA."""
    if device.type != "cuda":
        return device
    import os

    index = int(os.environ.get("LOCAL_RANK", device.index or 0))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class EpochBatches(Sampler[list[Key]]):
    """This worker's share of every global batch of an epoch, as ``(index, epoch)`` keys; see the module.

    Args:
        size: images in the data set.
        batch_size: images per global batch (a multiple of the workers).
        seed: the job's seed; the order of epoch ``e`` is keyed by it, ``name`` and ``e``.
        name: what the order is for (``"fine-tune order"``).
        shuffle: a new permutation every epoch, else the data's own order.
        drop_last: drop a last global batch smaller than ``batch_size`` (one smaller than the workers always is).
    """

    def __init__(self, size: int, batch_size: int, *, seed: int, name: str, shuffle: bool = True,
                 drop_last: bool = False) -> None:
        self.rank, self.world = rank_and_world()
        if batch_size % self.world:
            raise ValueError(f"batch size {batch_size} is not a multiple of the {self.world} workers")
        self.size, self.batch_size = size, batch_size
        self.seed, self.name = seed, name
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> "EpochBatches":
        """Makes the next pass epoch ``epoch``'s."""
        self.epoch = epoch
        return self

    def __len__(self) -> int:
        full, rest = divmod(self.size, self.batch_size)
        return full + (1 if rest >= self.world and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[Key]]:
        order = self._order()  # [size]
        for step in range(len(self)):
            batch = order[step * self.batch_size:(step + 1) * self.batch_size]
            share = len(batch) // self.world
            mine = batch[self.rank * share:(self.rank + 1) * share]  # [share]
            yield [(int(index), self.epoch) for index in mine]

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        return torch.randperm(self.size, generator=generator(self.seed, self.name, str(self.epoch)))


def rank_block(dataset: Dataset) -> Dataset:
    """This worker's contiguous block of ``dataset`` (the whole of it in one process)."""
    rank, world = rank_and_world()
    if world == 1:
        return dataset
    start, stop = partition_range(len(dataset), rank, world)
    return Subset(dataset, range(start, stop))


@dataclass(frozen=True)
class Loading:
    """Where a job computes and how it decodes: ``device``, and ``workers`` decoding processes per job process."""

    device: torch.device
    workers: int = 0

    @property
    def pin_memory(self) -> bool:
        return self.device.type == "cuda"

    def epochs(self, dataset: Dataset, sampler: EpochBatches,
               collate_fn: Callable | None = None) -> Callable[[int], DataLoader]:
        """The loader of ``sampler``'s batches of epoch ``e``, for each ``e``."""
        loader = self._loader(dataset, batch_sampler=sampler, collate_fn=collate_fn)

        def epoch(number: int) -> DataLoader:
            sampler.set_epoch(number)
            return loader

        return epoch

    def in_order(self, dataset: Dataset, batch_size: int, collate_fn: Callable | None = None) -> DataLoader:
        """The loader of ``dataset`` in its order, in batches of ``batch_size`` (evaluation, extraction)."""
        return self._loader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn)

    def _loader(self, dataset: Dataset, **options) -> DataLoader:
        return DataLoader(dataset, num_workers=self.workers, pin_memory=self.pin_memory, generator=torch.Generator(),
                          **{key: value for key, value in options.items() if value is not None})

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the device, copied asynchronously from pinned memory."""
        return tensor.to(self.device, non_blocking=self.pin_memory)

    def images(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, 3, S, S]`` images on the device, normalised there with ImageNet's statistics (float32)."""
        return normalise(self.to_device(pixels))
