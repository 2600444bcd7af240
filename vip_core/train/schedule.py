"""Learning-rate schedules, in logical steps: linear warmup, then cosine decay (or constant)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from vip_core.config import TrainingConfig


def lr_at(
    step: int,
    *,
    peak_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr: float = 0.0,
    schedule: Literal["cosine", "constant"] = "cosine",
) -> float:
    """The learning rate for logical step ``step`` (0-based).

    Warmup rises linearly to ``peak_lr`` (step ``warmup_steps - 1`` reaches it); then cosine decays from
    ``peak_lr`` to ``min_lr`` at ``total_steps``, or stays at ``peak_lr`` for ``"constant"``.

    Args:
        step: logical steps already taken.
        peak_lr: the rate after warmup.
        total_steps: the planned number of logical steps.
        warmup_steps: steps of linear warmup.
        min_lr: the final rate of the cosine.
        schedule: ``"cosine"`` or ``"constant"``.
    """
    if step < 0 or total_steps <= 0:
        raise ValueError(f"need step >= 0 and total_steps > 0, got step={step}, total_steps={total_steps}")
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak_lr
    if schedule != "cosine":
        raise ValueError(f"schedule must be 'cosine' or 'constant', got {schedule!r}")
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule (see :func:`lr_at`)."""

    peak_lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr: float = 0.0
    kind: Literal["cosine", "constant"] = "cosine"

    @classmethod
    def of(cls, training: TrainingConfig) -> "Schedule":
        """The schedule of a pre-training stage."""
        return cls(peak_lr=training.peak_lr, total_steps=training.steps, warmup_steps=training.warmup_steps,
                   min_lr=training.min_lr, kind=training.schedule)

    def lr(self, step: int) -> float:
        return lr_at(step, peak_lr=self.peak_lr, total_steps=self.total_steps, warmup_steps=self.warmup_steps,
                     min_lr=self.min_lr, schedule=self.kind)
