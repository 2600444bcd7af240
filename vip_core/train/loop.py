"""A single-process private training loop, built from a step, a budget check and checkpoint state.

The pieces stay apart so that a multi-worker launcher can reuse them:

* :func:`private_step` takes one DP-AdamW step on one Poisson-sampled logical batch and touches no
  process-global state (its randomness comes from the :class:`TrainState`'s generators);
* :func:`checkpoint_state` / :func:`restore_state` turn a :class:`TrainState` into the checkpoint entries
  (``stage, step, optimizer, ledger, sampler, rng``) and back;
* :func:`train_private` is the loop: it stops *before* a step would take ε past the target, saves a
  checkpoint every ``checkpoint_every`` steps and at the end, and resumes from one, continuing the ledger.

The loss function receives a microbatch of dataset *indices* and loads what it needs, so a logical batch
is streamed one physical batch at a time (``loss_fn(model, indices) -> [b]`` losses).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from vip_core.config import TrainingConfig, VipConfig
from vip_core.privacy.engine import StepStats, privatized_gradients
from vip_core.privacy.ledger import PrivacyLedger
from vip_core.privacy.optimizer import dp_adamw, set_learning_rate
from vip_core.privacy.plan import PrivacyPlan
from vip_core.privacy.sampling import PoissonSampler
from vip_core.train.schedule import lr_at

logger = logging.getLogger(__name__)

IndexLoss = Callable[[nn.Module, torch.Tensor], torch.Tensor]
STAGE = "private"


@dataclass
class TrainState:
    """Everything a private run carries from step to step.

    Attributes:
        model: the model being trained.
        optimizer: DP-AdamW over its trainable parameters.
        sampler: the Poisson sampler (its q is the ledger's q).
        ledger: the privacy ledger.
        noise: the generator of the Gaussian noise.
        masking: the generator of per-sample randomness in the loss (MAE masks), see :func:`mae_index_loss`.
        step: logical steps taken.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    sampler: PoissonSampler
    ledger: PrivacyLedger
    noise: torch.Generator
    masking: torch.Generator
    step: int = 0


@dataclass(frozen=True)
class StepReport:
    """One step's metrics. ``loss`` and ``examples`` are not privatized: for monitoring only."""

    step: int
    epsilon: float
    lr: float
    loss: float
    examples: int
    seconds: float


@dataclass
class TrainResult:
    """How a run ended: ``steps`` taken in all, ε spent, whether the budget stopped it, the last checkpoint."""

    steps: int
    epsilon: float
    stopped_by_budget: bool
    checkpoint: Path | None
    reports: list[StepReport] = field(default_factory=list)


def build_state(model: nn.Module, plan: PrivacyPlan, training: TrainingConfig, seed: int | None = None) -> TrainState:
    """A fresh state for ``plan``: sampler and ledger share the plan's q (DESIGN rule 1).

    Args:
        model: the model.
        plan: the privacy plan (q, σ, δ, C, accountant).
        training: the private stage's hyperparameters.
        seed: seeds the sampling and noise generators (tests); fresh OS entropy when None.
    """
    sampling, noise, masking = torch.Generator(), torch.Generator(), torch.Generator()
    for offset, generator in enumerate((sampling, noise, masking)):
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed + offset)
    optimizer = dp_adamw(model, lr=training.peak_lr, betas=training.betas, weight_decay=training.weight_decay)
    return TrainState(
        model=model,
        optimizer=optimizer,
        sampler=PoissonSampler(plan.dataset_size, plan.sample_rate, sampling),
        ledger=PrivacyLedger(plan.noise_multiplier, plan.sample_rate, plan.delta, plan.accountant),
        noise=noise,
        masking=masking,
    )


def mae_index_loss(images: Callable[[torch.Tensor], torch.Tensor], masking: torch.Generator) -> IndexLoss:
    """The MAE's per-sample loss on the images at some indices, with masks drawn from ``masking``.

    Args:
        images: ``images(indices) -> [b, 3, H, W]``, the examples at ``indices``.
        masking: the generator of the masks (one independent row of noise per sample).
    """

    def loss_fn(model: nn.Module, indices: torch.Tensor) -> torch.Tensor:
        device = next(model.parameters()).device
        return model(images(indices).to(device), generator=masking)[0]  # [b]

    return loss_fn


def private_step(
    state: TrainState, loss_fn: IndexLoss, plan: PrivacyPlan, training: TrainingConfig
) -> StepReport:
    """One logical step: Poisson sample, privatized gradient in physical batches, DP-AdamW, ledger.

    Args:
        state: the run's state, advanced in place.
        loss_fn: ``loss_fn(model, indices) -> [b]`` per-sample losses of the examples at ``indices``.
        plan: the privacy plan.
        training: the stage's hyperparameters (lr schedule, physical batch size).
    """
    started = time.perf_counter()
    lr = lr_at(
        state.step, peak_lr=training.peak_lr, total_steps=training.steps, warmup_steps=training.warmup_steps,
        min_lr=training.min_lr, schedule=training.schedule,
    )
    set_learning_rate(state.optimizer, lr)
    indices = state.sampler.sample()  # indices: [k], k ~ Binomial(N, q)
    stats: StepStats = privatized_gradients(
        state.model, loss_fn, indices, max_grad_norm=plan.max_grad_norm, noise_multiplier=plan.noise_multiplier,
        expected_batch_size=plan.sample_rate * plan.dataset_size,
        physical_batch_size=training.physical_batch_size, generator=state.noise,
    )
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    epsilon = state.ledger.record_step()
    return StepReport(
        step=state.step, epsilon=epsilon, lr=lr, loss=stats.loss_sum / max(stats.examples, 1),
        examples=stats.examples, seconds=time.perf_counter() - started,
    )


def checkpoint_state(state: TrainState) -> dict[str, Any]:
    """The checkpoint entries of ``state`` besides the model and config (see the team contracts)."""
    return {
        "stage": STAGE,
        "step": state.step,
        "optimizer": state.optimizer.state_dict(),
        "ledger": state.ledger.state_dict(),
        "sampler": state.sampler.state_dict(),
        "rng": {"noise": state.noise.get_state(), "masking": state.masking.get_state()},
    }


def restore_state(state: TrainState, payload: dict[str, Any]) -> None:
    """Loads a checkpoint written from :func:`checkpoint_state` (plus ``model``) into ``state``.

    Raises:
        ValueError: the checkpoint is not of a private stage, or its ledger's q differs from the sampler's.
    """
    if payload.get("stage") != STAGE or payload.get("ledger") is None:
        raise ValueError(f"checkpoint is of stage {payload.get('stage')!r} with no privacy ledger; cannot resume")
    ledger = PrivacyLedger.from_state_dict(payload["ledger"])
    if ledger.sample_rate != state.sampler.sample_rate:
        raise ValueError(f"checkpoint ledger q={ledger.sample_rate} differs from the sampler's q={state.sampler.sample_rate}")
    state.model.load_state_dict(payload["model"])
    state.optimizer.load_state_dict(payload["optimizer"])
    state.sampler.load_state_dict(payload["sampler"])
    state.noise.set_state(payload["rng"]["noise"])
    state.masking.set_state(payload["rng"]["masking"])
    state.ledger = ledger
    state.step = int(payload["step"])


def train_private(
    state: TrainState,
    loss_fn: IndexLoss,
    plan: PrivacyPlan,
    config: VipConfig,
    *,
    output: str | Path | None = None,
    resume: bool = False,
    on_step: Callable[[StepReport], None] | None = None,
) -> TrainResult:
    """Runs private steps until ``config.private.steps`` or the ε budget, whichever comes first.

    Args:
        state: a state from :func:`build_state`.
        loss_fn: ``loss_fn(model, indices) -> [b]`` per-sample losses.
        plan: the privacy plan.
        config: the run's configuration (its ``private`` stage and ``privacy`` budget are used).
        output: a directory for ``checkpoint.pt``; no checkpoints when None.
        resume: continue from ``output``'s checkpoint when there is one.
        on_step: called with every step's report (ε is a metric at every step).
    """
    from vip_core.models.checkpoint import checkpoint_file, load_checkpoint

    training = config.private
    if resume and output is not None and checkpoint_file(output).exists():
        restore_state(state, load_checkpoint(output))
        logger.info("resumed at step %d, epsilon %.4f", state.step, state.ledger.epsilon)
    result = TrainResult(steps=state.step, epsilon=state.ledger.epsilon, stopped_by_budget=False, checkpoint=None)
    saved_at = None
    while state.step < training.steps:
        if not state.ledger.can_step(plan.target_epsilon):
            result.stopped_by_budget = True
            logger.info("stopping before step %d: it would pass epsilon %.4f", state.step + 1, plan.target_epsilon)
            break
        report = private_step(state, loss_fn, plan, training)
        result.reports.append(report)
        if on_step is not None:
            on_step(report)
        if output is not None and state.step % training.checkpoint_every == 0:
            result.checkpoint, saved_at = _save(output, state, config), state.step
    if output is not None and saved_at != state.step:
        result.checkpoint = _save(output, state, config)
    result.steps, result.epsilon = state.step, state.ledger.epsilon
    return result


def _save(output: str | Path, state: TrainState, config: VipConfig) -> Path:
    from vip_core.models.checkpoint import save_checkpoint

    return save_checkpoint(output, model=state.model, config=config, **checkpoint_state(state))
