"""The privacy ledger: ε per step, the stop rule, and resuming from a checkpoint's state."""

from __future__ import annotations

import pytest

from vip_core.privacy.accounting import compute_epsilon
from vip_core.privacy.ledger import PrivacyLedger

SETTING = dict(noise_multiplier=1.0, sample_rate=0.1, delta=1e-5, accountant="pld")


def _ledger(steps: int = 0) -> PrivacyLedger:
    return PrivacyLedger(SETTING["noise_multiplier"], SETTING["sample_rate"], SETTING["delta"],
                         SETTING["accountant"], steps=steps)


def test_epsilon_after_each_step_is_the_accountants_value_for_that_many_steps():
    ledger = _ledger()
    assert ledger.epsilon == 0.0
    reported = [ledger.record_step() for _ in range(5)]
    assert reported == [compute_epsilon(steps=t, **SETTING) for t in range(1, 6)]
    assert reported == sorted(reported) and ledger.steps == 5 and ledger.epsilon == reported[-1]


def test_can_step_stops_before_the_target_would_be_passed():
    ledger = _ledger()
    target = compute_epsilon(steps=4, **SETTING)
    while ledger.can_step(target):
        ledger.record_step()
    assert ledger.steps == 4
    assert ledger.epsilon <= target < ledger.epsilon_after(5)


def test_state_dict_round_trip_continues_the_count():
    ledger = _ledger()
    for _ in range(3):
        ledger.record_step()
    resumed = PrivacyLedger.from_state_dict(ledger.state_dict())
    assert resumed.steps == 3 and resumed.epsilon == ledger.epsilon
    resumed.record_step()
    assert resumed.epsilon == compute_epsilon(steps=4, **SETTING)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="sample_rate"):
        PrivacyLedger(1.0, 0.0, 1e-5, "pld")
    with pytest.raises(ValueError, match="accountant"):
        PrivacyLedger(1.0, 0.1, 1e-5, "moments")
