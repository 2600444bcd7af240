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
    param_groups: list[dict] | None = None,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of ``model``: a decayed and a non-decayed group, or ``param_groups``.

    Step it after :func:`vip_core.privacy.engine.privatized_gradients` has set the ``.grad`` fields.

    Args:
        model: the model.
        lr: the learning rate (the schedule overwrites it every step).
        betas: Adam's moment decays.
        weight_decay: decoupled decay for parameters of 2 or more dimensions.
        eps: Adam's epsilon.
        param_groups: groups of one's own (e.g. layer-decayed, each with an ``lr_scale``); they must hold
            every trainable parameter.

    Raises:
        ValueError: ``param_groups`` leaves a trainable parameter out (it would be clipped but never trained).
    """
    if param_groups is None:
        decay, no_decay = [], []
        for param in model.parameters():
            if param.requires_grad:
                (decay if param.dim() >= 2 else no_decay).append(param)
        param_groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    grouped = {id(p) for group in param_groups for p in group["params"]}
    left_out = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in grouped]
    if left_out:
        raise ValueError(f"the optimizer's parameter groups leave out trainable parameters: {', '.join(left_out[:5])}")
    # foreach: a few operations per group instead of a dozen per parameter (torch's default on CUDA, not on the CPU)
    return torch.optim.AdamW([g for g in param_groups if g["params"]], lr=lr, betas=betas, eps=eps, foreach=True)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Sets ``lr`` times the group's ``lr_scale`` (1 by default) in every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
