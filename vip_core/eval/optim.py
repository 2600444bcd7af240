"""Optimisation pieces shared by the evaluation jobs: layer-wise lr decay and the lr schedule."""

from __future__ import annotations

import math

from torch import nn

_EMBEDDINGS = ("cls_token", "pos_embed", "reg_token", "patch_embed")
_TOKENS = ("cls_token", "pos_embed", "reg_token")


def layer_id(name: str, depth: int) -> int:
    """Layer of an encoder parameter: 0 for the embeddings, i + 1 for block i, depth + 1 after the blocks."""
    if name.startswith(_EMBEDDINGS):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def layer_decay_param_groups(model: nn.Module, encoder_prefix: str, depth: int, lr: float, weight_decay: float,
                             layer_decay: float) -> list[dict]:
    """AdamW parameter groups: a parameter of layer l learns at ``lr * layer_decay ** (depth + 1 - l)``.

    Parameters outside the encoder (named without ``encoder_prefix``) are at the top layer and learn at
    ``lr``. Biases, norms (1-D parameters) and the cls/position tokens get no weight decay. Parameters
    that do not require gradients are left out.
    """
    groups: dict[tuple[int, bool], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        inner = name.removeprefix(encoder_prefix)
        layer = layer_id(inner, depth) if name.startswith(encoder_prefix) else depth + 1
        decays = param.ndim > 1 and not (name.startswith(encoder_prefix) and inner.startswith(_TOKENS))
        scale = layer_decay ** (depth + 1 - layer)
        group = groups.setdefault((layer, decays), {"params": [], "lr": lr * scale, "lr_scale": scale,
                                                    "weight_decay": weight_decay if decays else 0.0})
        group["params"].append(param)
    return list(groups.values())


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """The learning-rate multiplier: linear warmup over ``warmup`` steps, then half a cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))
