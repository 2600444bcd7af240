"""DP-AdamW: the privatized gradient into AdamW with decoupled weight decay.

Adam's moments are post-processing of the privatized gradient, so they cost no privacy. Weight decay is
decoupled (AdamW) and applies to matrices and tokens only, not to biases and normalisation scales, as in
MAE pre-training.
"""

from __future__ import annotations

import torch
from torch import nn


def dp_adamw(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.05,
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of ``model``, in a decayed and a non-decayed group.

    Step it after :func:`vip_core.privacy.engine.privatized_gradients` has set the ``.grad`` fields.

    Args:
        model: the model.
        lr: the learning rate (the schedule overwrites it every step).
        betas: Adam's moment decays.
        weight_decay: decoupled decay for parameters of 2 or more dimensions.
        eps: Adam's epsilon.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Sets ``lr`` in every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
