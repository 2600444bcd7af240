"""Privacy ledgers: what a private data set has spent, over every run that trained on it.

Two pieces:

* :class:`LedgerBook`: one JSON file per private data set (``<ledgers>/<fingerprint>.json``; the tasks keep
  them in ``$VIP_HOME/ledgers``, or in ``$VIP_LEDGER_DIR``) that
  lists every run charged to the set, each as a :class:`Charge` ``(run, σ, q, steps, purpose)``. A run is
  charged with its planned steps when it is planned (before its first step), so a run that dies and is
  never resumed stays charged in full; at its end the charge is set to the steps it took. A resumed run
  updates its own charge (runs are keyed by id), never adds a second one.
* :class:`PrivacyLedger`: the ledger of one run in progress. Its ε is the *composed* ε of the set: the
  run's own steps composed with the charges of the set's other runs (``prior``). ε is computed for the
  exact number of steps taken (never interpolated, so never under-reported) by
  :mod:`vip_core.privacy.accounting`, whose results are memoised, when it is asked for; whether one more
  step fits the target is decided from the most steps the target allows, found once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from vip_core.atomic import write_json
from vip_core.privacy.accounting import DEFAULT_ACCOUNTANT, check_arguments, composed_epsilon

# The neighbouring data sets the (ε, δ) guarantee is stated for: one sample replaced by a null sample that
# contributes nothing to the clipped sum. Both sets have the same N, so publishing N, q = B/N and δ = 1/(2N) does
# not tell them apart; each pair of outputs is an add-or-remove pair, so the same Poisson-subsampled Gaussian
# accounting bounds it.
ADJACENCY = "zero-out"

@dataclasses.dataclass(frozen=True)
class Charge:
    """One run's use of a private data set.

    Attributes:
        run: the run's id (unique per run; a resumed run keeps its id).
        noise_multiplier: σ of its steps.
        sample_rate: q of its steps.
        steps: steps charged (planned, then taken).
        purpose: what the run was (``pretrain-dp``, ``dp-finetune``, ...).
    """

    run: str
    noise_multiplier: float
    sample_rate: float
    steps: int
    purpose: str

    @property
    def mechanism(self) -> tuple[float, float, int]:
        return (self.noise_multiplier, self.sample_rate, self.steps)


def compose(charges: Sequence[Charge], *, delta: float, accountant: str) -> float:
    """The composed ε of ``charges`` at ``delta``."""
    return composed_epsilon([charge.mechanism for charge in charges], delta=delta, accountant=accountant)


class PrivacyLedger:
    """Counts the private steps of one run and reports the ε of its data set: these steps composed with
    the set's ``prior`` charges.

    Args:
        noise_multiplier: σ of every step.
        sample_rate: q, the Poisson sampling probability of every step.
        delta: δ at which ε is reported.
        accountant: the accountant's name.
        prior: the charges of the data set's other runs.
        steps: steps already taken (a resumed run, or the earlier runs of a plan that runs several times).
    """

    def __init__(
        self, noise_multiplier: float, sample_rate: float, delta: float, accountant: str = DEFAULT_ACCOUNTANT,
        prior: Sequence[Charge] = (), steps: int = 0,
    ) -> None:
        check_arguments(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps, delta=delta,
                        accountant=accountant)
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.delta = float(delta)
        self.accountant = accountant
        self.prior = tuple(prior)
        self.steps = int(steps)
        self._max_steps: dict[float, int] = {}

    @property
    def epsilon(self) -> float:
        """ε of the data set after the steps recorded so far (composed with the prior charges)."""
        return self.epsilon_after(self.steps)

    def epsilon_after(self, steps: int) -> float:
        """ε of the data set once this run has taken ``steps`` steps."""
        own = [(self.noise_multiplier, self.sample_rate, steps)]
        return composed_epsilon([*(c.mechanism for c in self.prior), *own], delta=self.delta,
                                accountant=self.accountant)

    def can_step(self, target_epsilon: float) -> bool:
        """Whether one more step keeps ε at or below ``target_epsilon`` (no accountant call but the first)."""
        return self.steps + 1 <= self.max_steps(target_epsilon)

    def max_steps(self, target_epsilon: float) -> int:
        """The most steps this run may take: a count whose ε is at most ``target_epsilon`` and whose next is not.

        Found once per target by doubling, then bisection, on the accountant's ε. The true ε grows with the
        steps, so every prefix of a run whose ε bound is within the target is within it as well.
        """
        if target_epsilon not in self._max_steps:
            within, beyond = 0, max(1, self.steps + 1)
            while self.epsilon_after(beyond) <= target_epsilon:
                within, beyond = beyond, beyond * 2
                if beyond > 2**40:
                    raise ValueError(f"target_epsilon {target_epsilon} is never reached: the noise is too large")
            while beyond - within > 1:
                middle = (within + beyond) // 2
                if self.epsilon_after(middle) <= target_epsilon:
                    within = middle
                else:
                    beyond = middle
            self._max_steps[target_epsilon] = within
        return self._max_steps[target_epsilon]

    def record_step(self) -> None:
        """Counts one step taken (ε after it is :attr:`epsilon`, computed when asked)."""
        self.steps += 1

    def summary(self) -> dict[str, Any]:
        """What a published checkpoint carries: ε, δ, σ, q, steps, accountant, the adjacency ε is stated for, and
        the other runs composed in."""
        return {
            "epsilon": self.epsilon, "delta": self.delta, "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate, "steps": self.steps, "accountant": self.accountant,
            "adjacency": ADJACENCY, "composed_with": [dataclasses.asdict(charge) for charge in self.prior],
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate, "delta": self.delta,
            "accountant": self.accountant, "steps": self.steps,
            "prior": [dataclasses.asdict(charge) for charge in self.prior],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "PrivacyLedger":
        prior = [Charge(**charge) for charge in state.get("prior", ())]
        return cls(state["noise_multiplier"], state["sample_rate"], state["delta"], state["accountant"],
                   prior=prior, steps=state["steps"])

    def __repr__(self) -> str:
        return (f"PrivacyLedger(noise_multiplier={self.noise_multiplier}, sample_rate={self.sample_rate}, "
                f"delta={self.delta}, accountant={self.accountant!r}, steps={self.steps}, prior={len(self.prior)})")


class LedgerBook:
    """The charges of one private data set, kept in a JSON file (or in memory, for data that is not a
    private set, such as the audit's canaries).

    Args:
        path: the JSON file; None keeps the charges in memory only.
        fingerprint: the data set's fingerprint, recorded in the file and checked when it is read.
    """

    def __init__(self, path: str | os.PathLike[str] | None, fingerprint: str) -> None:
        self.path = Path(path) if path is not None else None
        self.fingerprint = fingerprint
        self._memory: dict[str, Charge] = {}

    @classmethod
    def for_data_set(cls, fingerprint: str, folder: str | os.PathLike[str]) -> "LedgerBook":
        """The book of the data set ``fingerprint`` in the ledger folder ``folder``."""
        return cls(Path(folder) / f"{fingerprint}.json", fingerprint)

    @classmethod
    def in_memory(cls, fingerprint: str = "not-a-private-set") -> "LedgerBook":
        return cls(None, fingerprint)

    @contextlib.contextmanager
    def locked(self) -> Iterator["LedgerBook"]:
        """Holds the book's lock (an exclusive ``flock``), so that planning against the charges and adding
        a charge happen with no other run in between."""
        if self.path is None:
            yield self
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield self
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def charges(self, *, excluding: str | None = None) -> tuple[Charge, ...]:
        """Every charge, in the order made, but the run ``excluding``."""
        return tuple(charge for run, charge in self._read().items() if run != excluding)

    def charge(self, charge: Charge) -> None:
        """Adds ``charge``, or replaces the charge of the same run. Call it inside :meth:`locked`."""
        charges = self._read()
        charges[charge.run] = charge
        if self.path is None:
            self._memory = charges
            return
        payload = {"fingerprint": self.fingerprint,
                   "charges": [dataclasses.asdict(item) for item in charges.values()]}
        write_json(self.path, payload)

    def epsilon(self, *, delta: float, accountant: str) -> float:
        """The composed ε of every charge."""
        return compose(self.charges(), delta=delta, accountant=accountant)

    def _read(self) -> dict[str, Charge]:
        if self.path is None:
            return dict(self._memory)
        if not self.path.is_file():
            return {}
        payload = json.loads(self.path.read_text())
        if payload.get("fingerprint") != self.fingerprint:
            raise ValueError(f"{self.path} is the ledger of data set {payload.get('fingerprint')}, "
                             f"not {self.fingerprint}")
        return {item["run"]: Charge(**item) for item in payload["charges"]}
