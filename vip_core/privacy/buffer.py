"""The privatized gradients' storage: one flat float32 tensor per device, and the step's noise drawn into it.

Every trainable parameter's running sum is a view of its device's flat tensor, parameters of one shape consecutive,
so that a group of layers of one shape adds its clipped sums with one operation (:meth:`GradientBuffer.add_rows`).
The noise is drawn into the flat tensors first and the clipped sums are added on top: each parameter's noise enters
its sum exactly once, whatever the number of microbatches. At the end the flat tensors are divided by the expected
batch size (and summed over workers), and each float32 parameter's ``.grad`` is its view. The tensors are kept from
step to step (no allocation, fixed addresses): a step's gradients are overwritten by the next step's noise.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn
from torch.profiler import record_function

from vip_core.privacy.randomness import GaussianDraw


class GradientBuffer:
    """The flat float32 sums of ``params`` (trainable parameters), one tensor per device."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        by_shape: dict[tuple, list[nn.Parameter]] = {}
        for param in params:
            by_shape.setdefault((param.device, tuple(param.shape)), []).append(param)
        sizes: dict[torch.device, int] = {}
        for (device, _), members in by_shape.items():
            sizes[device] = sizes.get(device, 0) + sum(p.numel() for p in members)
        self.flats = {device: torch.empty(size, dtype=torch.float32, device=device) for device, size in sizes.items()}
        self.rows: dict[int, tuple[torch.Tensor, int]] = {}  # id(param) -> (its shape's region [R, n], its row)
        self.views: list[tuple[nn.Parameter, torch.Tensor]] = []
        offsets = dict.fromkeys(sizes, 0)
        for (device, shape), members in by_shape.items():
            width = members[0].numel()
            start = offsets[device]
            region = self.flats[device][start:start + width * len(members)].view(len(members), width)  # [R, n]
            offsets[device] = start + width * len(members)
            for row, param in enumerate(members):
                self.rows[id(param)] = (region, row)
                self.views.append((param, region[row].view(shape)))
        self.targets: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.lock = threading.Lock()  # held by a sum's writes, closing it and zeroing a failed one's (engine.py)

    def add_rows(self, params: list[nn.Parameter], values: torch.Tensor) -> None:
        """Adds ``values`` ``[L, n]`` (one row per parameter of one shape) to the sums of ``params``: one in-place
        addition where their rows are consecutive, else one ``index_add_``."""
        key = tuple(map(id, params))
        if key not in self.targets:
            self.targets[key] = self._target(params)
        rows, index = self.targets[key]
        if index is None:
            rows.add_(values)
        else:
            rows.index_add_(0, index, values)

    def _target(self, params: list[nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where ``params``' sums are: their consecutive rows ``[L, n]`` and None, or their shape's region and the
        index of their rows (kept from step to step: a group's parameters are the same at every step)."""
        region, first = self.rows[id(params[0])]
        if any(self.rows[id(param)][0] is not region for param in params):
            raise ValueError("add_rows: the parameters do not share one shape's region of the buffer")
        rows = tuple(self.rows[id(param)][1] for param in params)
        if rows == tuple(range(first, first + len(rows))):
            return region[first:first + len(rows)], None
        return region, torch.tensor(rows, device=region.device)

    def set_gradients(self, expected_batch_size: float, all_reduce: Callable[[torch.Tensor], None] | None) -> None:
        """Sums each flat tensor over workers (``all_reduce``, in place), divides it by ``expected_batch_size`` and
        sets each parameter's ``.grad``: its view, or a copy in the parameter's dtype where that is not float32."""
        for flat in self.flats.values():
            if all_reduce is not None:
                all_reduce(flat)
            flat.div_(expected_batch_size)
        for param, view in self.views:
            param.grad = view if param.dtype == torch.float32 else view.to(param.dtype)


class StepNoise:
    """One step's Gaussian noise in the buffer's flat tensors (draw tensor ``k`` for the ``k``-th device), or zeros
    when ``draw`` is None (σ = 0). A device's noise is drawn at once (on a CUDA device by its generators, ordered
    before the sums on its stream; in secure mode on the CPU and copied); a CPU tensor's by helper threads, block by
    block, started at once where torch's threads leave cores idle, else when :meth:`wait` is first called (helpers
    competing with torch's threads would slow its matmuls more than the draw costs)."""

    def __init__(self, buffer: GradientBuffer, draw: GaussianDraw | None) -> None:
        self.futures: list[Future] = []
        self.pending: list[tuple[int, torch.Tensor]] = []
        for index, flat in enumerate(buffer.flats.values()):
            if draw is None:
                flat.zero_()
            elif flat.device.type == "cpu":
                self.pending.append((index, flat))
            else:
                draw.fill_whole(index, flat)
        self.draw = draw
        if self.pending and idle_cores() > 0:
            self._start()

    def _start(self) -> None:
        pool = noise_pool(max(idle_cores(), torch.get_num_threads()))
        self.futures = [pool.submit(self.draw.fill, index, flat, block)
                        for index, flat in self.pending for block in GaussianDraw.blocks(flat.numel())]
        self.pending = []

    def wait(self) -> None:
        """Returns once every coordinate is drawn (raising what a helper raised)."""
        if self.pending:
            self._start()
        if self.futures:
            with record_function("vip.noise_wait"):
                for future in self.futures:
                    future.result()
            self.futures = []

    def stop(self) -> None:
        """Cancels the blocks no helper has started (a step that failed) and waits for the others."""
        for future in self.futures:
            future.cancel()
        for future in self.futures:
            if not future.cancelled():
                future.exception()
        self.futures, self.pending = [], []


def usable_cores() -> int:
    """The cores this process may run on (all of the machine's where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def idle_cores() -> int:
    """The cores torch's threads leave idle."""
    return usable_cores() - torch.get_num_threads()


_POOLS_LOCK = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def noise_pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` noise helpers, kept from step to step (a thread's set-up costs are paid
    once)."""
    with _POOLS_LOCK:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, "vip-noise")
        return _pools[threads]


os.register_at_fork(after_in_child=_pools.clear)  # a forked child has none of the parent's threads
