"""The training loop: steps until the planned number or the ε budget, whichever comes first.

It runs any :class:`~vip_core.train.step.TrainingStep` (the private one or the plain one) and leaves what
happens around a step to its caller: metrics (``on_step``) and checkpoints (``on_checkpoint``, every
``checkpoint_every`` steps and at the end). The Ray worker, DP fine-tuning and the audit use it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from vip_core.train.step import Batch, LossFn, Observer, StepReport, TrainingStep

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoopResult:
    """How a run ended: ``steps`` taken in all, ε spent (None without privacy), whether the budget stopped it."""

    steps: int
    epsilon: float | None
    stopped_by_budget: bool


def run_steps(
    step: TrainingStep, batch: Batch, loss_fn: LossFn, *, until: int,
    on_step: Callable[[StepReport], None] | None = None,
    on_checkpoint: Callable[[], None] | None = None, checkpoint_every: int | None = None,
    observe: Observer | None = None,
) -> LoopResult:
    """Steps until ``step.taken == until``, stopping *before* a step that would pass the ε budget.

    Args:
        step: the step (its ``taken`` count may be above 0 after a resume).
        batch: ``batch(local_indices, sample_stream) -> inputs``.
        loss_fn: ``loss_fn(model, inputs) -> [b]``.
        until: the planned number of steps.
        on_step: called with every step's report.
        on_checkpoint: called every ``checkpoint_every`` steps, and at the end unless it was just called
            (so at least once per call, also when no step was left to take).
        checkpoint_every: the checkpoint period in steps; only at the end when None.
        observe: passed to every step (see :meth:`TrainingStep.__call__`).
    """
    stopped = False
    checkpointed_at = None
    while step.taken < until:
        if not step.can_step():
            stopped = True
            logger.info("stopping before step %d: it would pass the epsilon budget", step.taken + 1)
            break
        report = step(batch, loss_fn, observe)
        if on_step is not None:
            on_step(report)
        if on_checkpoint is not None and checkpoint_every and step.taken % checkpoint_every == 0:
            on_checkpoint()
            checkpointed_at = step.taken
    if on_checkpoint is not None and checkpointed_at != step.taken:
        on_checkpoint()
    return LoopResult(steps=step.taken, epsilon=step.epsilon, stopped_by_budget=stopped)
