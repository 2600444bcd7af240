"""The privacy plan of a private run: q, δ and σ for the measured data set, composed with the set's ledger.

Planning happens in one function, :func:`plan_privacy`, for every private run (pre-training, DP
fine-tuning, the audit). The data set's size is measured, never typed in, and the set is named by its
fingerprint, whose :class:`~vip_core.privacy.ledger.LedgerBook` lists the runs that already trained on
it: σ is calibrated so that the set's composed ε, those runs included, stays within the target.
:func:`plan_and_charge` plans and charges the book under its lock, so two runs cannot both spend the
same remaining budget.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any, Protocol, Sequence

from vip_core.config import ConfigError
from vip_core.privacy.accounting import calibrate_noise_multiplier
from vip_core.privacy.ledger import Charge, LedgerBook, PrivacyLedger, compose

log = logging.getLogger(__name__)

# What a resumed run must share with the run it continues, or its ledger would not describe its steps (and
# the steps it was charged for would not be the steps it takes); causes before consequences (a new batch
# size changes q, which changes a calibrated σ).
RESUME_FIELDS = ("dataset_size", "fingerprint", "batch_size", "sample_rate", "steps", "runs", "target_epsilon",
                 "delta", "accountant", "max_grad_norm", "noise_multiplier", "secure_mode")


class PrivacyBudget(Protocol):
    """The privacy settings of a run (``PrivacyConfig``, ``FinetunePrivacyConfig``)."""

    target_epsilon: float
    delta: float | None
    max_grad_norm: float
    noise_multiplier: float | None
    accountant: str
    secure_mode: bool
    strict_float32: bool


@dataclasses.dataclass(frozen=True)
class PrivacyPlan:
    """What a private run executes, and the ε it will have spent.

    Attributes:
        dataset_size: N, the measured number of private examples.
        fingerprint: the data set's fingerprint (its shard or file list and counts).
        batch_size: B, the expected logical batch size (the divisor of the clipped sum).
        sample_rate: q = B / N, the Poisson sampling probability.
        steps: logical steps of one run.
        runs: how many runs of this plan are charged (DP fine-tuning trains two encoders).
        delta: δ; 1/(2N) unless configured.
        noise_multiplier: σ; calibrated to ``target_epsilon`` unless configured.
        max_grad_norm: C, the per-sample clipping norm.
        target_epsilon: the budget of the data set, all its runs composed.
        epsilon: the data set's composed ε once every planned step is taken.
        accountant: the accountant's name.
        secure_mode: draw every random number from the OS CSPRNG (see :mod:`vip_core.privacy.randomness`).
        prior: the charges of the data set's other runs, composed into ε.
        strict_float32: IEEE float32 per-sample norms and clipped sums (:mod:`vip_core.privacy.numerics`); not part
            of the accounting, and a resumed run may change it.
    """

    dataset_size: int
    fingerprint: str
    batch_size: int
    sample_rate: float
    steps: int
    runs: int
    delta: float
    noise_multiplier: float
    max_grad_norm: float
    target_epsilon: float
    epsilon: float
    accountant: str
    secure_mode: bool
    prior: tuple[Charge, ...] = ()
    strict_float32: bool = False

    def ledger(self, earlier_runs: int = 0) -> PrivacyLedger:
        """A fresh ledger for run ``earlier_runs`` of this plan (the earlier ones count as taken)."""
        return PrivacyLedger(self.noise_multiplier, self.sample_rate, self.delta, self.accountant,
                             prior=self.prior, steps=earlier_runs * self.steps)

    def charge(self, run: str, purpose: str, steps: int | None = None) -> Charge:
        """The book entry of run ``run`` of this plan: the planned steps unless ``steps`` is given."""
        return Charge(run=run, noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate,
                      steps=self.steps if steps is None else steps, purpose=purpose)

    def epsilon_by(self, accountant: str, steps: int | None = None, *, earlier_runs: int = 0) -> float:
        """The data set's composed ε by ``accountant`` once run ``earlier_runs`` of this plan has taken ``steps``
        steps (its earlier runs counted whole, as :meth:`ledger` does); every planned step of every run when
        ``steps`` is None."""
        taken = self.steps * self.runs if steps is None else earlier_runs * self.steps + steps
        own = Charge("planned", self.noise_multiplier, self.sample_rate, taken, "planned")
        return compose([*self.prior, own], delta=self.delta, accountant=accountant)

    def tight_epsilon(self, steps: int | None = None, *, earlier_runs: int = 0) -> float | None:
        """The PLD ε beside a plan accounted by RDP (loose; the ViP paper's accountant), None for another plan."""
        return self.epsilon_by("pld", steps, earlier_runs=earlier_runs) if self.accountant == "rdp" else None

    def describe_epsilon(self) -> str:
        """The planned ε with its accountant, and the tight PLD one beside RDP: ``ε 7.99 (rdp; pld 6.83)``."""
        tight = self.tight_epsilon()
        return f"ε {self.epsilon:.2f} ({self.accountant}" + ("" if tight is None else f"; pld {tight:.2f}") + ")"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (for plan.json, MLflow tags and checkpoints)."""
        return {**dataclasses.asdict(self), "prior": [dataclasses.asdict(c) for c in self.prior]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrivacyPlan":
        """The plan of :meth:`to_dict` (fields an older version saved and this one lacks are left out)."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**{**known, "prior": tuple(Charge(**c) for c in data.get("prior", ()))})

    def mismatch(self, other: dict[str, Any]) -> str | None:
        """The first of ``RESUME_FIELDS`` (then the other runs composed in) whose value in ``other`` differs,
        as ``"field=theirs, the plan gives ours"``."""
        for field in RESUME_FIELDS:
            theirs = other.get(field, _saved_default(field))  # a plan saved before the field existed
            if theirs != getattr(self, field):
                return f"{field}={theirs!r}, the plan gives {getattr(self, field)!r}"
        theirs = tuple(Charge(**charge) for charge in other.get("prior", ()))
        if theirs != self.prior:
            return f"{len(theirs)} earlier runs composed in, the plan composes {len(self.prior)}"
        return None


def _saved_default(field: str) -> Any:
    """What a plan saved without ``field`` ran with: the field's default (None for a field that has none)."""
    default = PrivacyPlan.__dataclass_fields__[field].default
    return None if default is dataclasses.MISSING else default


def plan_privacy(
    budget: PrivacyBudget, *, dataset_size: int, batch_size: int, steps: int, fingerprint: str,
    prior: Sequence[Charge] = (), runs: int = 1, field: str = "privacy", batch_field: str = "private.batch_size",
) -> PrivacyPlan:
    """The plan of ``runs`` runs of ``steps`` steps at expected batch ``batch_size`` over ``dataset_size``
    examples, composed with the data set's ``prior`` charges.

    Args:
        budget: the privacy settings (target ε, δ, C, σ or None to calibrate, accountant, secure mode).
        dataset_size: N, measured.
        batch_size: B, the expected logical batch size.
        steps: steps of one run.
        fingerprint: the data set's fingerprint.
        prior: charges of the set's other runs.
        runs: runs of this plan (each charged ``steps``).
        field: the settings' name in the configuration, for error messages.
        batch_field: the batch size's name in the configuration, for error messages.

    Raises:
        ConfigError: the batch is larger than the data set, the earlier runs leave no budget, or a
            configured σ overspends it; the message names the field.
    """
    if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < 1:
        raise ConfigError(f"dataset_size: must be a positive integer, got {dataset_size!r}")
    if batch_size > dataset_size:
        raise ConfigError(f"{batch_field}: {batch_size} is larger than the data set ({dataset_size} examples)")
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    sample_rate = batch_size / dataset_size
    delta = budget.delta if budget.delta is not None else 1.0 / (2 * dataset_size)
    if delta >= 1.0 / dataset_size:
        log.warning("delta %.3g is not below 1/N = %.3g: the guarantee is weak", delta, 1.0 / dataset_size)
    sigma = budget.noise_multiplier
    if sigma is None:
        try:
            sigma = calibrate_noise_multiplier(
                target_epsilon=budget.target_epsilon, sample_rate=sample_rate, steps=steps * runs, delta=delta,
                accountant=budget.accountant, prior=[charge.mechanism for charge in prior])
        except ValueError:
            spent = compose(prior, delta=delta, accountant=budget.accountant)
            raise ConfigError(
                f"{field}.target_epsilon: {budget.target_epsilon} cannot be met: the data set has spent epsilon "
                f"{spent:.4f} ({_runs_of(prior)}), which leaves no room for {steps * runs} more steps"
            ) from None
    own = Charge("planned", float(sigma), sample_rate, steps * runs, "planned")
    epsilon = compose([*prior, own], delta=delta, accountant=budget.accountant)
    if epsilon > budget.target_epsilon:
        raise ConfigError(
            f"{field}.noise_multiplier: sigma {sigma} reaches epsilon {epsilon:.3f} after {steps * runs} steps "
            f"({_runs_of(prior)}), above {field}.target_epsilon {budget.target_epsilon}"
        )
    return PrivacyPlan(
        dataset_size=dataset_size, fingerprint=fingerprint, batch_size=batch_size, sample_rate=sample_rate,
        steps=steps, runs=runs, delta=delta, noise_multiplier=float(sigma), max_grad_norm=budget.max_grad_norm,
        target_epsilon=budget.target_epsilon, epsilon=epsilon, accountant=budget.accountant,
        secure_mode=budget.secure_mode, prior=tuple(prior), strict_float32=budget.strict_float32,
    )


def plan_and_charge(
    book: LedgerBook, *, runs: Sequence[str], purpose: str, prior: Sequence[Charge] | None = None,
    **planning: Any,
) -> PrivacyPlan:
    """Plans against ``book`` and charges it with every run of the plan (their planned steps), under its lock.

    Args:
        book: the data set's ledger book.
        runs: the ids of the runs this plan charges (one per run; a resumed run passes its own id again).
        purpose: what the runs are, recorded with each charge.
        prior: the charges to compose with; the book's charges of other runs when None. A resumed run
            passes the prior of its original plan, so its σ comes out the same.
        **planning: the arguments of :func:`plan_privacy` but ``prior`` and ``runs``.
    """
    with book.locked():
        if prior is None:
            prior = tuple(charge for charge in book.charges() if charge.run not in runs)
        plan = plan_privacy(prior=prior, runs=len(runs), **planning)
        for run in runs:
            book.charge(plan.charge(run, purpose))
    return plan


def settle_charge(book: LedgerBook, plan: PrivacyPlan, run: str, purpose: str, steps: int) -> None:
    """Sets run ``run``'s charge to the steps it took (at its end: fewer than planned if the budget stopped it)."""
    with book.locked():
        book.charge(plan.charge(run, purpose, steps=steps))


def fingerprint_of(entries: Sequence[tuple[str, int, int]]) -> str:
    """A data set's fingerprint: SHA-256 of its ``(name, bytes, label)`` entries (files), in order."""
    digest = hashlib.sha256(json.dumps([list(entry) for entry in entries]).encode())
    return digest.hexdigest()[:32]


def _runs_of(prior: Sequence[Charge]) -> str:
    if not prior:
        return "no earlier run on this data set"
    names = ", ".join(f"{c.purpose} {c.run} ({c.steps} steps, sigma {c.noise_multiplier:.4g})" for c in prior)
    return f"composed with the data set's earlier runs: {names}"
