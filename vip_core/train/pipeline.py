"""The input pipeline: the next steps' Poisson samples drawn ahead and decoded in worker processes (or
threads) while the current step runs.

A step's Poisson sample does not depend on the model, so :class:`InputPipeline` draws the samples of the
next ``ahead`` steps from the step's own :class:`~vip_core.privacy.sampling.PoissonSampler` in the training
process (the same stream, in the same order: the indices of step t are exactly those an unprefetched run
draws at step t, so the privacy analysis is unchanged) and hands each sample's decoding, in chunks, to a
small pool of decoders as soon as it is drawn. A decoder gets only local indices and returns uint8
``[c, 3, H, W]`` (or a NamedTuple of such ``[c, ...]`` tensors: a :class:`~vip_core.train.data.Decoded` says
which images are usable); the step then finds its images decoded (pinned when they go to a GPU); normalising and the
per-sample randomness (masks and crops, from the step's ``sample`` stream) happen at step time on the device. Memory
is bounded by ``ahead + 1`` steps of uint8 images.

Decoders are processes by default (:data:`PROCESSES`) or threads (:data:`THREADS`: they share the training
process's GIL with the step's Python work; PIL releases it while it decodes). A process is started fresh
(``spawn``: the Ray worker has threads, so it is never forked), receives the ``load`` callable once (e.g. a
:class:`~vip_core.train.data.ShardPartition`'s bound ``pixels``: the shard paths or URLs and where each image
lies) and opens the shards itself; the decoded chunk comes back pickled (a copy of its uint8 bytes: 0.4 MB
for 32 images of 64 px). On a quiet 2-core machine processes kept tiny's step fed where threads did not, under
load threads did better (the measurements are in CHANGELOG.md).

The decoding processes are stopped by :meth:`InputPipeline.close`, or when the pipeline is garbage collected,
or when its process exits, before multiprocessing's exit joins its children (a pipeline left open in a
spawned process once hung that exit for good: the decoders never got their stop signal). Stopping waits
``min(timeout, STOP_GRACE_S)`` seconds at most, then kills the decoders still running (their results are
dropped anyway); a decoder ends by itself when the training process that started it is gone (killed). In a
main process Python's own exit first waits for the decode jobs already queued, before this hook runs: close
the pipeline there (the pre-training worker does, in a ``finally``).

It stands in for the step's sampler (``sample``, ``state_dict``, ``load_state_dict``), so a checkpoint holds
the sampler state *as of the last step taken*, not of the draws made ahead: a resumed run draws the same
sequence of samples as an uninterrupted one. A decoder that fails, or a result that does not come within
``timeout`` seconds, is a one-line error naming the step.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import threading
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from functools import partial
from multiprocessing.process import BaseProcess
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from vip_core.privacy.sampling import PoissonSampler
from vip_core.train.augment import apply_crop_flips
from vip_core.train.data import normalise
from vip_core.train.precision import autocast

log = logging.getLogger(__name__)

Load = Callable[[torch.Tensor], Any]  # local indices [k] -> a tensor [k, ...] or a NamedTuple of them

PROCESSES = "processes"
THREADS = "threads"
DECODE_MODES = (PROCESSES, THREADS)
DECODE_MODE = PROCESSES
DECODE_TIMEOUT_S = 600.0
MIN_CHUNK = 64  # images per decoding job at least: each job costs the training process about 0.5 ms of CPU
STOP_GRACE_S = 10.0  # what a closing pipeline gives its decoders to stop: their results are dropped anyway
# multiprocessing runs exit finalizers by decreasing priority; its queues' feeder threads stop at 10. The decoders
# are stopped before, while their queue can still carry the stop signals.
_STOP_BEFORE_QUEUES = 20


def decode_workers(cpus: float) -> int:
    """Decoders of a training worker given ``cpus`` CPUs: one per CPU, at least two."""
    return max(2, round(cpus))


def mae_loss(model: nn.Module, pixels: torch.Tensor, noise: torch.Tensor, precision: str,
             crops: torch.Tensor | None = None, *, views: int = 1) -> torch.Tensor:
    """The MAE's per-sample loss ``[b]`` (float32) of uint8 images ``pixels`` ``[b, 3, H, W]``, averaged over
    ``views`` views of each image (augmentation multiplicity, De et al. 2022).

    Row i of ``noise`` ``[b, views * L]`` holds image i's masking noise of each view in turn, and row i of ``crops``
    ``[b, views * 5]`` (when given, :mod:`vip_core.train.augment`) its crop and flip of each view. Everything moves
    to the model's device; each view is cropped and flipped there, normalised, and its forward runs in
    ``precision`` on all ``b`` images at once, so every layer still sees the microbatch's rows on dim 0. The mean
    over the views is one image's loss, so its gradient is still one sample's contribution to the clipped sum.
    """
    device = next(model.parameters()).device
    pixels = pixels.to(device, non_blocking=True)  # [b, 3, H, W] uint8
    noise = noise.to(device).unflatten(1, (views, -1))  # [b, views, L]
    crops = None if crops is None else crops.unflatten(1, (views, -1))  # [b, views, 5]
    losses = [_view_loss(model, pixels, noise[:, view], precision, None if crops is None else crops[:, view])
              for view in range(views)]  # views × [b]
    return torch.stack(losses, dim=1).mean(dim=1)  # [b]


def _view_loss(model: nn.Module, pixels: torch.Tensor, noise: torch.Tensor, precision: str,
               crops: torch.Tensor | None) -> torch.Tensor:
    """The MAE's loss ``[b]`` of one view: images ``[b, 3, H, W]`` (uint8, on the model's device) cropped and flipped
    by ``crops`` ``[b, 5]`` when given, normalised, masked by ``noise`` ``[b, L]``."""
    if crops is not None:
        pixels = apply_crop_flips(pixels.float(), crops)  # [b, 3, H, W] float in 0..255
    imgs = normalise(pixels)  # imgs: [b, 3, H, W]
    with autocast(precision, pixels.device):
        return model(imgs, noise=noise)[0].float()  # [b]


class InputPipeline:
    """A Poisson sampler whose next ``ahead`` samples are drawn and decoded in advance.

    Args:
        sampler: the step's sampler (its stream is the only one drawn from, always in this process).
        load: ``load(local_indices [k]) -> uint8 [k, 3, H, W]`` (e.g. :meth:`ShardPartition.pixels`); called in
            the decoders (with :data:`PROCESSES`, it is pickled once into each and must open its data itself).
        ahead: steps drawn and decoded beyond the one being taken (at least 1).
        workers: decoders (processes or threads); a sample is cut into at most this many chunks, each of at
            least ``MIN_CHUNK`` images (a sample of fewer than ``2 * MIN_CHUNK`` is one chunk).
        mode: :data:`PROCESSES` or :data:`THREADS`.
        pin_memory: pin the decoded images (for a fast copy to a GPU).
        timeout: seconds :meth:`pixels` waits for a chunk before it fails; :meth:`close` waits for the
            decoding processes to stop ``min(timeout, STOP_GRACE_S)`` seconds before it kills them.
    """

    def __init__(self, sampler: PoissonSampler, load: Load, *, ahead: int = 2, workers: int = 2,
                 mode: str = DECODE_MODE, pin_memory: bool = False, timeout: float = DECODE_TIMEOUT_S) -> None:
        if ahead < 1:
            raise ValueError(f"ahead must be at least 1 step, got {ahead}")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.sampler = sampler
        self.ahead = ahead
        self.workers = workers
        self.mode = mode
        self.pin_memory = pin_memory
        self.timeout = timeout
        self._pool, self._job = _decoders(mode, load, workers)
        # close(), or the pipeline's garbage collection, or the exit of this process, whichever comes first
        self._stop = multiprocessing.util.Finalize(self, _stop_decoders, args=(self._pool, min(timeout, STOP_GRACE_S)),
                                                   exitpriority=_STOP_BEFORE_QUEUES)
        self._queue: collections.deque[_Draw] = collections.deque()
        self._taken_state = sampler.state_dict()
        self._current: _Draw | None = None

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
        self._current = self._queue.popleft()
        self._taken_state = self._current.state
        while len(self._queue) < self.ahead:
            self._draw()
        return self._current.local

    def pixels(self, local: torch.Tensor) -> Any:
        """The decoded images ``[k, 3, H, W]`` (uint8; or what ``load`` returns, each part ``[k, ...]``) of the sample
        :meth:`sample` returned last.

        Raises:
            ValueError: ``local`` is not that sample.
            RuntimeError: a decoder failed or took longer than ``timeout`` (one line, naming the step).
        """
        if self._current is None or self._current.local is not local:
            raise ValueError("pixels() is asked for a sample other than the last one sample() returned")
        draw, self._current = self._current, None
        pixels = _cat([self._result(future, draw.step) for future in draw.futures])  # [k, 3, H, W]
        return _each(lambda tensor: tensor.pin_memory(), pixels) if self.pin_memory else pixels

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state after the last step taken (the draws made ahead are not in it)."""
        return self._taken_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from :meth:`state_dict`: the draws made ahead are dropped and drawn again."""
        self._drop()
        self.sampler.load_state_dict(state)
        self._taken_state = self.sampler.state_dict()

    def close(self) -> None:
        """Drops the draws made ahead and stops the decoders (processes still running after
        ``min(timeout, STOP_GRACE_S)`` s are killed). A pipeline left open is closed when it is garbage
        collected or when its process exits."""
        self._drop()
        self._stop()

    def _draw(self) -> None:
        """Draws one more step's sample, keeps the sampler state after it, and starts decoding it."""
        local = self.sampler.sample()  # local: [k]
        self._queue.append(_Draw(self.sampler.steps_drawn, local, self.sampler.state_dict(), self._submit(local)))

    def _submit(self, local: torch.Tensor) -> list[Future]:
        """Decoding jobs of balanced sizes, at most one per worker and each of at least ``MIN_CHUNK`` images (a
        small sample is one job; the samples drawn ahead give the other workers theirs); an empty sample is one
        empty chunk."""
        jobs = max(1, min(self.workers, len(local) // MIN_CHUNK))
        return [self._pool.submit(self._job, chunk.tolist()) for chunk in torch.tensor_split(local, jobs)]

    def _result(self, future: Future, step: int) -> torch.Tensor:
        """A chunk's images ``[c, 3, H, W]`` (uint8), or a one-line error naming the step."""
        if not wait([future], timeout=self.timeout).done:
            raise RuntimeError(f"decoding the sample of step {step} took longer than {self.timeout:g} s "
                               f"({self.workers} {self.mode})")
        try:
            return _each(torch.as_tensor, future.result())  # [c, 3, H, W]
        except Exception as error:
            first_line = (str(error).splitlines() or [""])[0]
            raise RuntimeError(f"decoding the sample of step {step} failed in the {self.mode}: "
                               f"{type(error).__name__}: {first_line}") from error

    def _drop(self) -> None:
        for draw in self._queue:
            for future in draw.futures:
                future.cancel()
        self._queue.clear()
        self._current = None


class _Draw(NamedTuple):
    """One step's sample drawn ahead: the step it is for, its indices ``[k]``, the sampler state after it and
    its decoding jobs."""

    step: int
    local: torch.Tensor
    state: dict[str, Any]
    futures: list[Future]


def _decoders(mode: str, load: Load, workers: int) -> tuple[Executor, Callable[[list[int]], Any]]:
    """The pool of decoders and the job it runs on a chunk's indices: threads calling ``load``, or fresh
    processes (spawned, never forked) that each received ``load`` once."""
    if mode == THREADS:
        return ThreadPoolExecutor(workers, thread_name_prefix="vip-input"), partial(_load_indices, load)
    if mode == PROCESSES:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_hold_in_process, initargs=(load,))
        return pool, _decode_in_process
    raise ValueError(f"decode mode must be one of {', '.join(DECODE_MODES)}, got {mode!r}")


def _stop_decoders(pool: Executor, timeout: float) -> None:
    """Cancels the jobs not started and stops the decoders: threads are waited for; processes are given
    ``timeout`` seconds to finish the chunk they decode and are killed after it."""
    if isinstance(pool, ThreadPoolExecutor):
        pool.shutdown(wait=True, cancel_futures=True)
        return
    # concurrent.futures has no public handle on its processes, nor on the thread that stops and reaps them
    processes, manager = list((pool._processes or {}).values()), pool._executor_manager_thread
    pool.shutdown(wait=False, cancel_futures=True)  # the manager thread sends each process the stop signal
    stuck = _still_running(processes, timeout)
    for process in stuck:
        process.kill()
    _still_running(stuck, timeout)  # a killed process is gone at once; its sentinel says so
    if manager is not None:
        manager.join(timeout)  # it has reaped them all when it ends
    if stuck:
        log.warning("%d decoding processes still running %g s after the input pipeline closed were killed",
                    len(stuck), timeout)


def _still_running(processes: list[BaseProcess], timeout: float) -> list[BaseProcess]:
    """The processes that have not exited within ``timeout`` seconds (watched through their sentinels, so the
    executor's own thread stays the one that reaps them)."""
    running = {process.sentinel: process for process in processes}
    deadline = time.monotonic() + timeout
    while running and (left := deadline - time.monotonic()) > 0:
        for sentinel in multiprocessing.connection.wait(list(running), timeout=left):
            del running[sentinel]
    return list(running.values())


def _each(function: Callable[[Any], Any], value: Any) -> Any:
    """``function`` applied to a tensor, or to each part of a NamedTuple of them."""
    return type(value)(*(function(part) for part in value)) if isinstance(value, tuple) else function(value)


def _cat(chunks: list[Any]) -> Any:
    """Chunks ``[c, ...]`` (tensors, or NamedTuples of them) joined along the first dimension."""
    if len(chunks) == 1:
        return chunks[0]
    if isinstance(chunks[0], tuple):
        return type(chunks[0])(*(torch.cat(parts) for parts in zip(*chunks)))
    return torch.cat(chunks)


def _load_indices(load: Load, indices: list[int]) -> Any:
    return load(torch.tensor(indices, dtype=torch.long))  # [c, 3, H, W] uint8, or a NamedTuple of [c, ...]


_process_load: Load | None = None  # in a decoding process: the load it was started with


def _hold_in_process(load: Load) -> None:
    """Starts a decoding process: keeps ``load``; one torch thread (decoding is PIL's work); ends with its parent."""
    global _process_load
    torch.set_num_threads(1)
    _process_load = load
    parent = multiprocessing.parent_process()
    threading.Thread(target=_exit_when_gone, args=(parent.sentinel,), name="vip-input-parent", daemon=True).start()


def _exit_when_gone(parent_sentinel: int) -> None:
    """Ends this decoding process once its parent is gone: a killed training process (no close(), no exit
    finalizers) leaves no decoder waiting for work that will never come."""
    multiprocessing.connection.wait([parent_sentinel])
    os._exit(1)


def _decode_in_process(indices: list[int]) -> Any:
    """A chunk decoded in a decoding process, as numpy arrays (pickled back: a plain copy of their bytes)."""
    return _each(lambda tensor: tensor.numpy(), _load_indices(_process_load, indices))  # [c, 3, H, W] uint8
