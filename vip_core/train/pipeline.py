"""The input pipeline: the next steps' Poisson samples drawn ahead and decoded in worker threads while the
current step runs.

A step's Poisson sample does not depend on the model, so :class:`InputPipeline` draws the samples of the
next ``ahead`` steps from the step's own :class:`~vip_core.privacy.sampling.PoissonSampler` (the same
stream, in the same order: the indices of step t are exactly those an unprefetched run draws at step t, so
the privacy analysis is unchanged) and hands each sample's decoding to a thread pool, in chunks, as soon
as it is drawn. The step then finds its images decoded (uint8 ``[k, 3, H, W]``, pinned when they go to a
GPU); normalising and the per-sample randomness (masks and crops, from the step's ``sample`` stream) happen at
step time on the device. Memory is bounded by ``ahead + 1`` steps of uint8 images.

It stands in for the step's sampler (``sample``, ``state_dict``, ``load_state_dict``), so a checkpoint holds
the sampler state *as of the last step taken*, not of the draws made ahead: a resumed run draws the same
sequence of samples as an uninterrupted one. Decoding threads work in parallel because PIL releases the GIL
while it decodes and resizes.
"""

from __future__ import annotations

import collections
import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch import nn

from vip_core.privacy.sampling import PoissonSampler
from vip_core.train.augment import apply_crop_flips
from vip_core.train.data import normalise
from vip_core.train.precision import autocast

Load = Callable[[torch.Tensor], torch.Tensor]


def mae_loss(model: nn.Module, pixels: torch.Tensor, noise: torch.Tensor, precision: str,
             crops: torch.Tensor | None = None) -> torch.Tensor:
    """The MAE's per-sample loss ``[b]`` (float32) of uint8 images ``pixels`` ``[b, 3, H, W]`` under masking noise
    ``noise`` ``[b, L]``: both moved to the model's device, each image cropped and flipped there by its row of
    ``crops`` ``[b, 5]`` when given (:mod:`vip_core.train.augment`), then normalised, the forward in ``precision``."""
    device = next(model.parameters()).device
    pixels = pixels.to(device, non_blocking=True)  # [b, 3, H, W] uint8
    if crops is not None:
        pixels = apply_crop_flips(pixels.float(), crops)  # [b, 3, H, W] float in 0..255
    imgs = normalise(pixels)  # imgs: [b, 3, H, W]
    with autocast(precision, device):
        return model(imgs, noise=noise.to(device))[0].float()  # [b]


class InputPipeline:
    """A Poisson sampler whose next ``ahead`` samples are drawn and decoded in advance.

    Args:
        sampler: the step's sampler (its stream is the only one drawn from).
        load: ``load(local_indices [k]) -> uint8 [k, 3, H, W]`` (e.g. :meth:`ShardPartition.pixels`); called
            from worker threads.
        ahead: steps drawn and decoded beyond the one being taken (at least 1).
        threads: decoding threads; a sample is cut into this many chunks.
        pin_memory: pin the decoded images (for a fast copy to a GPU).
    """

    def __init__(self, sampler: PoissonSampler, load: Load, *, ahead: int = 2, threads: int = 2,
                 pin_memory: bool = False) -> None:
        if ahead < 1:
            raise ValueError(f"ahead must be at least 1 step, got {ahead}")
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.sampler = sampler
        self.load = load
        self.ahead = ahead
        self.threads = threads
        self.pin_memory = pin_memory
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vip-input")
        self._queue: collections.deque[tuple[torch.Tensor, dict[str, Any], list[Future]]] = collections.deque()
        self._taken_state = sampler.state_dict()
        self._current: tuple[torch.Tensor, list[Future]] | None = None

    @property
    def sample_rate(self) -> float:
        return self.sampler.sample_rate

    @property
    def dataset_size(self) -> int:
        return self.sampler.dataset_size

    def sample(self) -> torch.Tensor:
        """The indices ``[k]`` of the next step's sample (drawn ahead); the draws beyond it start decoding."""
        if not self._queue:
            self._draw()
        local, state, futures = self._queue.popleft()
        self._taken_state = state
        self._current = (local, futures)
        while len(self._queue) < self.ahead:
            self._draw()
        return local

    def pixels(self, local: torch.Tensor) -> torch.Tensor:
        """The decoded images ``[k, 3, H, W]`` (uint8) of the sample :meth:`sample` returned last.

        Raises:
            ValueError: ``local`` is not that sample.
        """
        if self._current is None or self._current[0] is not local:
            raise ValueError("pixels() is asked for a sample other than the last one sample() returned")
        chunks = [future.result() for future in self._current[1]]  # each [c, 3, H, W]
        self._current = None
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)  # [k, 3, H, W]

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state after the last step taken (the draws made ahead are not in it)."""
        return self._taken_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from :meth:`state_dict`: the draws made ahead are dropped and drawn again."""
        self._drop()
        self.sampler.load_state_dict(state)
        self._taken_state = self.sampler.state_dict()

    def close(self) -> None:
        """Drops the draws made ahead and stops the threads."""
        self._drop()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _draw(self) -> None:
        """Draws one more step's sample, keeps the sampler state after it, and starts decoding it."""
        local = self.sampler.sample()  # local: [k]
        self._queue.append((local, self.sampler.state_dict(), self._submit(local)))

    def _submit(self, local: torch.Tensor) -> list[Future]:
        """One decoding job per thread; an empty sample is one empty chunk."""
        size = max(1, math.ceil(len(local) / self.threads))
        return [self._pool.submit(self._decode, chunk) for chunk in torch.split(local, size)]

    def _decode(self, local: torch.Tensor) -> torch.Tensor:
        pixels = self.load(local)  # pixels: [c, 3, H, W] uint8
        return pixels.pin_memory() if self.pin_memory else pixels

    def _drop(self) -> None:
        for _, _, futures in self._queue:
            for future in futures:
                future.cancel()
        self._queue.clear()
        self._current = None
