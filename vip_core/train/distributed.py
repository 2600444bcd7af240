"""torch.distributed helpers for data-parallel (DP-)training; each works unchanged in a single process.

The private step across ``W`` workers (docs/privacy.md, rule 3):

1. every rank Poisson-samples its own block of the data with its own random stream;
2. every rank computes the clipped sum of its samples' gradients, divided by the public expected batch
   size; rank 0 alone adds the Gaussian noise N(0, σ²C²) (:func:`rank_noise_multiplier`);
3. the gradients are summed over ranks (:func:`all_reduce_in_place` on the engine's flat gradients), so the total noise has std σC whatever
   ``W`` is, and every rank then takes the same optimizer step from the same parameters.

:func:`parameters_fingerprint` and :func:`check_parameters_equal` verify the last point.

Public data-parallel training (the evaluation jobs) averages instead: :func:`average_gradients` after every
backward (each worker's gradient of its equal share of the global batch: their mean is the global batch's), and
:func:`average_buffers` for running statistics (BatchNorm) before they are saved or used.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn


def is_distributed() -> bool:
    """Whether a torch.distributed process group is up."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` without a process group."""
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_noise_multiplier(noise_multiplier: float, rank: int) -> float:
    """The σ rank ``rank`` passes to the privatized gradient: all of it on rank 0, none elsewhere."""
    return noise_multiplier if rank == 0 else 0.0


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def all_reduce_gradients(params: Iterable[nn.Parameter]) -> None:
    """Replaces each ``.grad`` by its SUM over ranks, in one flat all-reduce.

    A parameter without a gradient takes part as zeros (and keeps a zero gradient), so every rank
    reduces the same flat buffer.
    """
    params = list(params)
    if not is_distributed() or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])  # flat: [P]
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for param, grad in zip(params, grads):
        count = grad.numel()
        param.grad = flat[offset:offset + count].view_as(grad).clone()
        offset += count


def all_reduce_in_place(tensor: torch.Tensor) -> None:
    """Replaces ``tensor`` by its SUM over ranks (nothing without a process group)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def average_gradients(params: Iterable[nn.Parameter]) -> None:
    """Replaces each ``.grad`` by its mean over ranks (nothing to do in one process)."""
    params = list(params)
    if not is_distributed():
        return
    all_reduce_gradients(params)
    world = dist.get_world_size()
    for param in params:
        param.grad.div_(world)


def average_buffers(model: nn.Module) -> None:
    """Replaces each floating-point buffer (running means and variances) by its mean over ranks."""
    if not is_distributed():
        return
    for buffer in model.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer.data, op=dist.ReduceOp.SUM)
            buffer.data.div_(dist.get_world_size())


def barrier() -> None:
    """Waits for every rank (nothing to do in one process)."""
    if is_distributed():
        dist.barrier()


def all_reduce_sum(value: float) -> float:
    """``value`` summed over ranks (float64)."""
    return _all_reduce_scalar(value, dist.ReduceOp.SUM) if is_distributed() else float(value)


def all_reduce_max(value: float) -> float:
    """The largest ``value`` over ranks."""
    return _all_reduce_scalar(value, dist.ReduceOp.MAX) if is_distributed() else float(value)


def _all_reduce_scalar(value: float, op: dist.ReduceOp) -> float:
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(tensor, op=op)
    return float(tensor.item())


def _collective_device() -> torch.device:
    """Where the backend reduces tensors: the current GPU for NCCL, the CPU for gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Copies rank ``src``'s parameters and buffers to every rank."""
    if not is_distributed():
        return
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=src)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def parameters_fingerprint(model: nn.Module) -> str:
    """A SHA-256 digest of every parameter's name, shape and exact bytes."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(str(tuple(param.shape)).encode())
        digest.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_parameters_equal(model: nn.Module) -> None:
    """Raises RuntimeError naming the ranks whose parameters differ from rank 0's (bit for bit)."""
    fingerprints = gather_objects(parameters_fingerprint(model))
    differing = [rank for rank, fp in enumerate(fingerprints) if fp != fingerprints[0]]
    if differing:
        raise RuntimeError(f"parameters of ranks {differing} differ from rank 0's")
