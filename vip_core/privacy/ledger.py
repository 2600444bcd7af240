"""The privacy ledger of a training run: ε after every logical step, kept in every checkpoint.

ε is computed for the exact number of steps taken (never interpolated, so never under-reported) by the
accountant of :mod:`vip_core.privacy.accounting`, whose results are memoised: asking
:meth:`PrivacyLedger.can_step` before a step and :attr:`PrivacyLedger.epsilon` after it costs one
accountant call per step (about half a second on the paper's setting).
"""

from __future__ import annotations

from typing import Any

from vip_core.privacy.accounting import DEFAULT_ACCOUNTANT, check_arguments, compute_epsilon


class PrivacyLedger:
    """Counts the private steps of a run and reports the ε they spent.

    Args:
        noise_multiplier: σ of every step.
        sample_rate: q, the Poisson sampling probability of every step.
        delta: δ at which ε is reported.
        accountant: the accountant's name.
        steps: steps already taken (a resumed run).
    """

    def __init__(
        self, noise_multiplier: float, sample_rate: float, delta: float, accountant: str = DEFAULT_ACCOUNTANT,
        steps: int = 0,
    ) -> None:
        check_arguments(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps, delta=delta,
                        accountant=accountant)
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.delta = float(delta)
        self.accountant = accountant
        self.steps = int(steps)

    @property
    def epsilon(self) -> float:
        """ε spent by the steps recorded so far."""
        return self.epsilon_after(self.steps)

    def epsilon_after(self, steps: int) -> float:
        """ε that ``steps`` steps of this ledger's mechanism spend."""
        return compute_epsilon(
            noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate, steps=steps, delta=self.delta,
            accountant=self.accountant,
        )

    def can_step(self, target_epsilon: float) -> bool:
        """Whether one more step keeps ε at or below ``target_epsilon``."""
        return self.epsilon_after(self.steps + 1) <= target_epsilon

    def record_step(self) -> float:
        """Counts one step taken; returns ε after it."""
        self.steps += 1
        return self.epsilon

    def state_dict(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate, "delta": self.delta,
            "accountant": self.accountant, "steps": self.steps,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "PrivacyLedger":
        return cls(state["noise_multiplier"], state["sample_rate"], state["delta"], state["accountant"],
                   steps=state["steps"])

    def __repr__(self) -> str:
        return (f"PrivacyLedger(noise_multiplier={self.noise_multiplier}, sample_rate={self.sample_rate}, "
                f"delta={self.delta}, accountant={self.accountant!r}, steps={self.steps})")
