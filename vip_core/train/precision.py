"""The training precision: ``precision="bf16"`` runs forwards under bfloat16 autocast, ``"fp32"`` does not.

The engine keeps per-sample norms, clipping factors and clipped sums in float32 under autocast
(:mod:`vip_core.privacy.per_sample`), and parameters, gradients and AdamW's moments stay float32.
(torch is imported on use, so that the command line can list the precisions without loading it.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PRECISIONS = ("fp32", "bf16")


def autocast(precision: str, device: "torch.device | str") -> "torch.autocast":
    """``torch.autocast`` to bfloat16 on ``device``'s type for ``"bf16"``; disabled for ``"fp32"``."""
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16")
