"""The one fitting routine of the evaluation jobs: optimiser groups with layer-wise lr decay, the warmup-cosine
schedule and the epoch loop. Fine-tuning, detection, segmentation and the linear probe all train through it.

A job builds its optimiser (:func:`layer_decay_adamw` for a model around an encoder; the linear probe brings
LARS or SGD) and calls :func:`fit` with a function that yields an epoch's batches and one that turns a batch
into the loss. :func:`fit` steps the optimiser and the schedule once per batch and logs each epoch's last loss.

As one of several data-parallel workers (:mod:`vip_core.eval.loading`), each worker's batches are its share of the
global batches: the gradients are averaged over the workers after every backward and the running statistics after
every epoch, so every worker steps the same model. With an :class:`EpochCheckpoint`, the state after each epoch is
kept, and a job started again continues after the last epoch it finished.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from vip_core.atomic import atomic_path
from vip_core.train.distributed import average_buffers, average_gradients, rank_and_world

logger = logging.getLogger(__name__)

_EMBEDDINGS = ("cls_token", "pos_embed", "reg_token", "patch_embed")
_TOKENS = ("cls_token", "pos_embed", "reg_token")
WARMUP_FRACTION = 0.1


@dataclass(frozen=True, kw_only=True)
class FitSettings:
    """What the jobs that train an encoder end to end share: ``epochs`` at ``lr`` (for fine-tuning, the base
    rate per 256 examples) with layer-wise decay ``layer_decay`` and AdamW's ``weight_decay``; ``precision``
    ``"bf16"`` runs the forwards under bfloat16 autocast; ``batch_size`` is the global batch."""

    epochs: int
    lr: float
    batch_size: int
    layer_decay: float
    weight_decay: float = 0.05
    seed: int = 0
    precision: str = "fp32"


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


def layer_decay_adamw(model: nn.Module, encoder_prefix: str, *, lr: float, weight_decay: float,
                      layer_decay: float) -> torch.optim.AdamW:
    """AdamW (β 0.9, 0.999) over :func:`layer_decay_param_groups` of the encoder at ``encoder_prefix``
    (``"encoder."``, ``"backbone.encoder."``)."""
    depth = len(model.get_submodule(encoder_prefix.rstrip(".")).blocks)
    groups = layer_decay_param_groups(model, encoder_prefix, depth, lr, weight_decay, layer_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999))


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """The learning-rate multiplier: linear warmup over ``warmup`` steps, then half a cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Each group's lr times :func:`warmup_cosine` over ``total_steps``, the first 10 % of them warming up."""
    warmup = max(1, int(total_steps * WARMUP_FRACTION))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, total_steps, warmup))


class EpochCheckpoint:
    """A job's training state after its last finished epoch, in the file ``path`` (none when None).

    Rank 0 writes it after every epoch, whole or not at all; every rank reads it when the job starts again.
    """

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)

    def load(self) -> dict[str, Any] | None:
        """The state saved last, or None."""
        if self.path is None or not self.path.is_file():
            return None
        return torch.load(self.path, map_location="cpu", weights_only=True)

    def save(self, state: dict[str, Any]) -> None:
        if self.path is None or rank_and_world()[0] != 0:
            return
        with atomic_path(self.path) as partial:
            torch.save(state, partial)


def fit(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Callable[[int], Iterable[Any]],
        loss_of: Callable[[Any], torch.Tensor], *, epochs: int, steps_per_epoch: int, name: str,
        checkpoint: EpochCheckpoint | None = None, epoch_start: Callable[[int], None] | None = None) -> float:
    """Trains ``model`` for ``epochs`` epochs under the warmup-cosine schedule; returns the last loss.

    Args:
        model: put in training mode here (its device is the caller's).
        optimizer: over the model's parameters.
        batches: epoch ``e``'s batches (this worker's shares of them), at each call.
        loss_of: a batch's scalar loss (this worker's share's mean).
        epochs: passes over ``batches(e)``.
        steps_per_epoch: batches per epoch, which sizes the schedule.
        name: the job, in the log lines (``fine-tune epoch 0: last loss 2.3026``).
        checkpoint: where the state after each epoch is kept, and read back when the job starts again.
        epoch_start: called with each epoch before its first batch (to key the epoch's random draws).
    """
    schedule = warmup_cosine_schedule(optimizer, epochs * steps_per_epoch)
    first = _resume(checkpoint, model, optimizer, schedule, name)
    params = [param for param in model.parameters() if param.requires_grad]
    model.train()
    last = torch.tensor(math.nan)
    for epoch in range(first, epochs):
        if epoch_start is not None:
            epoch_start(epoch)
        for batch in batches(epoch):
            loss = loss_of(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            average_gradients(params)
            optimizer.step()
            schedule.step()
            last = loss.detach()
        average_buffers(model)
        logger.info("%s epoch %d: last loss %.4f", name, epoch, last.item())
        if checkpoint is not None:
            checkpoint.save({"epoch": epoch + 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "schedule": schedule.state_dict()})
    return last.item()


def _resume(checkpoint: EpochCheckpoint | None, model: nn.Module, optimizer: torch.optim.Optimizer,
            schedule: torch.optim.lr_scheduler.LRScheduler, name: str) -> int:
    """Loads the state a checkpoint holds; returns the epochs it finished (0 without one)."""
    state = checkpoint.load() if checkpoint is not None else None
    if state is None:
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    logger.info("%s resumes after epoch %d (%s)", name, state["epoch"], checkpoint.path)
    return int(state["epoch"])
