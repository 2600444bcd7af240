"""Privacy auditing in one training run (Steinke, Nasr and Jagielski, NeurIPS 2023): an empirical lower
bound on ε that the accountant's ε must not fall below.

m canaries are each included in the training set with probability 1/2. After training, the auditor
scores every canary, guesses "included" for the highest scores and "excluded" for the lowest, and
counts the correct guesses. Under (ε, δ)-DP the number of correct guesses is dominated by a binomial
with success probability e^ε / (1 + e^ε) (their Theorem 5.2 / Corollary 5.4, computed exactly as their
Appendix D's ``p_value_DP_audit``); the largest ε that the observed count rejects at the chosen
confidence is the lower bound (their ``get_eps_audit``).

The canaries here are white-box gradient canaries ("Dirac" canaries, their Section 7): the audited model
gets an extra plain parameter ``canary_probe [1, m]``, and canary i is an example whose loss is
``C · probe[i]``, so its gradient is C on coordinate i and 0 elsewhere, exactly the clipping bound.
Ordinary examples (random images for the MAE) never touch the probe. Training runs the private stage's
recipe through the step pre-training runs (:class:`~vip_core.train.step.PrivateStep`: Poisson sampling,
per-sample clipping over all parameters, Gaussian noise once per step, division by the public expected
batch size, DP-AdamW and its learning-rate schedule, fresh OS entropy), and canary i's score is the sum
over steps of the privatized gradient's coordinate i: what an adversary who sees the noisy gradients
(which DP-SGD's guarantee covers) observes. Input-space canaries for an MAE trained for a few steps have
no power; these have the most.

The bound adds 2·m·δ to every p-value, so it needs a small δ: the audit claims its ε at
:func:`default_delta` (0.01 / m) unless told otherwise, and σ is planned for that δ.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

import numpy as np
import torch
from scipy import stats
from torch import nn

from vip_core.config import ConfigError, VipConfig
from vip_core.eval.seeding import seeded

log = logging.getLogger(__name__)

# Guess budgets tried (r = guesses); each as "included" guesses only and split half/half. The confidence
# is shared among the candidates (Bonferroni), so choosing the best one keeps the bound valid.
GUESS_BUDGETS = (25, 50, 100, 200, 300, 500, 1000)
_BISECTION_STEPS = 30


# ------------------------------------------------------------------------------------------- statistics


def audit_p_value(*, canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """P[at least ``correct`` of ``guesses`` right] under (ε, δ)-DP: Steinke et al.'s Appendix D bound.

    Args:
        canaries: m, canaries each included with probability 1/2.
        guesses: r, guesses made (abstentions excluded).
        correct: v, correct guesses.
        epsilon: ε of the null hypothesis.
        delta: δ of the null hypothesis.
    """
    _check_counts(canaries, guesses, correct)
    p_right = 1.0 / (1.0 + math.exp(-epsilon))  # accuracy of ε-DP randomized response
    tail = float(stats.binom.sf(correct - 1, guesses, p_right))  # P[Binomial(r, p) >= v]
    if delta == 0 or correct == 0:
        return min(tail, 1.0)
    below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, p_right)  # P[B = v-1], ..., P[B = 0]
    alpha = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))  # max_i P[v > B >= v-i] / i
    return min(tail + alpha * delta * 2 * canaries, 1.0)


def epsilon_lower_bound(*, canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95) -> float:
    """The largest ε that ``correct`` of ``guesses`` rejects at ``confidence`` (Appendix D's ``get_eps_audit``).

    Returns:
        A lower bound on ε holding with probability ``confidence``; 0 when nothing is rejected.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must lie in [0, 1], got {delta}")
    level = 1.0 - confidence

    def rejected(epsilon: float) -> bool:
        return audit_p_value(canaries=canaries, guesses=guesses, correct=correct, epsilon=epsilon, delta=delta) < level

    low, high = 0.0, 1.0
    while rejected(high):
        high += 1.0
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        if rejected(middle):
            low = middle
        else:
            high = middle
    return low


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct <= guesses <= canaries, got {correct}, {guesses}, {canaries}")


@dataclasses.dataclass(frozen=True)
class AuditBound:
    """The best guess set's outcome.

    Attributes:
        canaries: m.
        guesses_included: guesses "included" (the highest scores).
        guesses_excluded: guesses "excluded" (the lowest scores).
        correct_guesses: v.
        epsilon_lower_bound: ε rejected at ``confidence`` (after sharing it among the candidates).
        confidence: the overall confidence.
    """

    canaries: int
    guesses_included: int
    guesses_excluded: int
    correct_guesses: int
    epsilon_lower_bound: float
    confidence: float

    @property
    def guesses(self) -> int:
        return self.guesses_included + self.guesses_excluded


def guess_and_bound(
    scores: Sequence[float] | np.ndarray, included: Sequence[bool] | np.ndarray, *, delta: float,
    confidence: float = 0.95, budgets: Sequence[int] = GUESS_BUDGETS,
) -> AuditBound:
    """Guesses from the scores alone (high: included), then the best lower bound over the guess sets.

    Each candidate guess set (every budget r <= m, as r "included" guesses or r/2 of each) is tested at
    level (1 - confidence) / candidates, so the best of them is a valid bound at ``confidence``.
    """
    scores = np.asarray(scores, dtype=np.float64)  # scores: [m]
    included = np.asarray(included, dtype=bool)  # included: [m]
    if scores.shape != included.shape or scores.ndim != 1 or len(scores) == 0:
        raise ValueError(f"scores and included must be two equal 1-d arrays, got {scores.shape}, {included.shape}")
    canaries = len(scores)
    order = np.argsort(-scores, kind="stable")  # highest score first; ties keep canary order (independent of inclusion)
    candidates = _candidate_guess_sets([r for r in budgets if r <= canaries] or [canaries])
    shared = 1.0 - (1.0 - confidence) / len(candidates)
    best = None
    for k_in, k_out in candidates:
        correct = int(included[order[:k_in]].sum()) + int((~included[order[canaries - k_out:]]).sum())
        bound = epsilon_lower_bound(canaries=canaries, guesses=k_in + k_out, correct=correct, delta=delta,
                                    confidence=shared)
        if best is None or bound > best.epsilon_lower_bound:
            best = AuditBound(canaries, k_in, k_out, correct, bound, confidence)
    return best


def _candidate_guess_sets(budgets: Sequence[int]) -> list[tuple[int, int]]:
    return sorted({(r, 0) for r in budgets} | {(r - r // 2, r // 2) for r in budgets if r >= 2})


# ------------------------------------------------------------------------------------------- training


class CanaryAuditModel(nn.Module):
    """The audited model plus the canary probe: canary i's loss is ``scale · canary_probe[i]``.

    Args:
        backbone: the model being trained (an MAE; its per-sample loss is ``backbone(images, noise=...)[0]``).
        canaries: m, the probe's width.
        scale: the canary gradient's norm (the clipping bound C).
    """

    def __init__(self, backbone: nn.Module, canaries: int, scale: float) -> None:
        super().__init__()
        self.backbone = backbone
        self.canary_probe = nn.Parameter(torch.zeros(1, canaries))
        self.scale = scale


def canary_audit_loss(model: CanaryAuditModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-sample losses [b] of a batch mixing ordinary examples and canaries.

    Row i is canary ``inputs["canary"][i]`` when that is >= 0: its loss is ``scale · probe[canary]``, whose
    gradient is ``scale`` on that coordinate of the probe and 0 elsewhere. Otherwise it is an ordinary
    example, whose loss is the MAE's on ``inputs["images"][i]`` masked by ``inputs["noise"][i]``. ``where``
    gives each row the gradient of its own kind only.
    """
    canary = inputs["canary"]  # canary: [b], -1 for ordinary rows
    probe = model.canary_probe.expand(len(canary), -1)  # probe: [b, m] (the engine's per-sample stand-in)
    canary_losses = model.scale * probe.gather(1, canary.clamp(min=0)[:, None])[:, 0]  # [b]
    mae_losses = model.backbone(inputs["images"], noise=inputs["noise"])[0]  # [b]
    return torch.where(canary >= 0, canary_losses, mae_losses)  # [b]


@dataclasses.dataclass(frozen=True)
class CanaryRun:
    """What one canary training run produced.

    Attributes:
        scores: [m] canary scores (sum over steps of the privatized gradient's probe coordinate).
        included: [m] which canaries were in the training set.
        dataset_size: the public dataset size the sample rate was set from (m/2 + ordinary examples).
        sample_rate: q.
        steps: logical steps.
        noise_multiplier: σ (0: a non-private run, no noise and no clipping).
        delta: δ of the run's privacy claim.
        epsilon_claimed: the accountant's ε (``math.inf`` for a non-private run).
        learning_rates: the rate of every step (the private stage's schedule).
    """

    scores: np.ndarray
    included: np.ndarray
    dataset_size: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    delta: float
    epsilon_claimed: float
    learning_rates: tuple[float, ...]


def default_delta(canaries: int) -> float:
    """δ at which an audit of ``canaries`` canaries has power: its bound adds 2·m·δ to every p-value, so
    δ = 0.01 / m keeps that term at 0.02 (the private stage's 1/(2N) on a small data set makes it exceed 1)."""
    return 0.01 / canaries


def train_with_canaries(config: VipConfig, canaries: int, *, ordinary: int | None = None, seed: int = 0,
                        delta: float | None = None) -> CanaryRun:
    """Trains ``config``'s MAE with its private-stage recipe on ordinary examples plus a random half of
    ``canaries`` canaries, and scores every canary.

    The recipe is the private stage's own: with ``config.privacy.enabled`` the run is
    :class:`~vip_core.train.step.PrivateStep` (the step pre-training runs: Poisson sampling, per-sample
    clipping, noise once, DP-AdamW and its learning-rate schedule) with σ planned by
    :func:`~vip_core.privacy.plan.plan_privacy` for the audit's public data set at ``delta``; without it,
    :class:`~vip_core.train.step.PlainStep` (plain gradients, as non-private pre-training computes them).

    Args:
        config: the run's configuration (model, ``private`` stage, ``privacy``).
        canaries: m >= 2.
        ordinary: ordinary examples (random images); the private batch size when None.
        seed: seeds the audit's design (which canaries are included, the ordinary images, the initial
            weights); the training streams of a private run draw fresh OS entropy, as in pre-training.
        delta: δ of the claim; ``config.privacy.delta`` when None, else :func:`default_delta`.
    """
    from vip_core.models.mae import build_mae
    from vip_core.train.loop import run_steps

    if canaries < 2:
        raise ValueError(f"canaries must be >= 2, got {canaries}")
    training = config.private
    ordinary = training.batch_size if ordinary is None else ordinary
    public_size = canaries // 2 + ordinary
    if delta is None:
        delta = config.privacy.delta if config.privacy.delta is not None else default_delta(canaries)
    design = torch.Generator().manual_seed(seed)
    included = torch.rand(canaries, generator=design) < 0.5  # included: [m]
    members = torch.nonzero(included).squeeze(1)  # members: [k] canary ids in the training set
    with seeded(seed):  # the MAE's initialisation draws from the global generator: alone, then restored
        model = CanaryAuditModel(build_mae(config.model), canaries, scale=config.privacy.max_grad_norm)
    dataset = _AuditDataset(members, ordinary, config, design)
    step, epsilon = _audit_step(model, config, public_size, delta, seed)
    scores = torch.zeros(canaries)  # scores: [m]

    def observe(audited: nn.Module) -> None:
        scores.add_(audited.canary_probe.grad[0].detach())

    rates: list[float] = []
    run_steps(step, dataset.batch, canary_audit_loss, until=training.steps, observe=observe,
              on_step=lambda report: rates.append(report.lr))
    sigma = step.plan.noise_multiplier if config.privacy.enabled else 0.0
    return CanaryRun(scores.numpy(), included.numpy(), public_size, step.sampler.sample_rate, len(rates), sigma,
                     delta, epsilon, tuple(rates))


def _audit_step(model: nn.Module, config: VipConfig, public_size: int, delta: float, seed: int):
    """The private stage's step for the audit's public data set at ``delta``, and the ε it claims."""
    from vip_core.privacy.plan import plan_privacy
    from vip_core.train.schedule import Schedule
    from vip_core.train.step import PlainStep, PrivateStep

    training = config.private
    options = dict(physical_batch_size=training.physical_batch_size, betas=training.betas,
                   weight_decay=training.weight_decay)
    if training.batch_size > public_size:
        raise ConfigError(f"private.batch_size: {training.batch_size} is larger than the audit set ({public_size})")
    if not config.privacy.enabled:
        step = PlainStep(model, Schedule.of(training), seed=seed, local_size=public_size,
                         sample_rate=training.batch_size / public_size, **options)
        return step, math.inf
    budget = config.privacy.model_copy(update={"delta": delta})
    plan = plan_privacy(budget, dataset_size=public_size, batch_size=training.batch_size, steps=training.steps,
                        fingerprint="audit-canaries")
    return PrivateStep(model, plan, Schedule.of(training), **options), plan.epsilon


class _AuditDataset:
    """Rows 0..k-1 are the included canaries, rows k.. the ordinary random images."""

    def __init__(self, members: torch.Tensor, ordinary: int, config: VipConfig, generator: torch.Generator) -> None:
        self.members = members  # members: [k]
        self.ordinary = ordinary
        self.shape = (config.model.in_chans, config.model.img_size, config.model.img_size)
        self.num_patches = config.model.num_patches
        self.image_seed = int(torch.randint(0, 2**62, (1,), generator=generator))

    def __len__(self) -> int:
        return len(self.members) + self.ordinary

    def batch(self, rows: torch.Tensor, stream: Any) -> dict[str, torch.Tensor]:
        """The step's inputs for dataset ``rows`` [b]: canary ids (-1 for ordinary rows), images (zeros for
        canary rows) and one row of masking noise per sample."""
        k = len(self.members)
        is_canary = rows < k  # [b]
        canary = torch.full((len(rows),), -1, dtype=torch.long)  # canary: [b]
        canary[is_canary] = self.members[rows[is_canary]]
        images = torch.stack([
            torch.zeros(self.shape) if int(row) < k
            else torch.rand(self.shape, generator=torch.Generator().manual_seed(self.image_seed + int(row)))
            for row in rows
        ]) if len(rows) else torch.zeros(0, *self.shape)  # images: [b, C, H, W]
        return {"canary": canary, "images": images, "noise": stream.uniform((len(rows), self.num_patches))}


def audit(config: VipConfig, canaries: int, *, confidence: float = 0.95, seed: int = 0,
          delta: float | None = None) -> dict[str, Any]:
    """One audit: a canary run, then the lower bound at the run's δ (:func:`default_delta` when None).

    Returns:
        ``epsilon_claimed`` (None for a non-private run), ``epsilon_lower_bound``, ``canaries``,
        ``correct_guesses``, ``guesses``, and the run's settings.
    """
    run = train_with_canaries(config, canaries, seed=seed, delta=delta)
    bound = guess_and_bound(run.scores, run.included, delta=run.delta, confidence=confidence)
    log.info("audit: %d of %d guesses right, epsilon >= %.3f (claimed %s)", bound.correct_guesses, bound.guesses,
             bound.epsilon_lower_bound, run.epsilon_claimed)
    return {
        "epsilon_claimed": run.epsilon_claimed if math.isfinite(run.epsilon_claimed) else None,
        "epsilon_lower_bound": bound.epsilon_lower_bound,
        "canaries": canaries,
        "correct_guesses": bound.correct_guesses,
        "guesses": bound.guesses,
        "guesses_included": bound.guesses_included,
        "confidence": confidence,
        "delta": run.delta,
        "noise_multiplier": run.noise_multiplier,
        "sample_rate": run.sample_rate,
        "steps": run.steps,
        "dataset_size": run.dataset_size,
        "private": config.privacy.enabled,
        "canary_kind": "white-box gradient (Dirac)",
    }
