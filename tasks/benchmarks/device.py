"""Where a benchmark's steps run: ``--device cpu | cuda``, checked once, and the wait for a GPU's kernels that ends
each timed span there."""

from __future__ import annotations

from typing import Any


def bench_device(name: str) -> Any:
    """``torch.device(name)``; a one-line error for ``cuda`` where torch sees no CUDA device."""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here")
    return torch.device(name)


def finish(device: Any) -> None:
    """Returns once ``device`` has run every kernel launched on it (at once on the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
