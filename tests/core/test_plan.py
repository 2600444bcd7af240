"""The privacy plan: q and δ from the measured dataset size, σ calibrated, a batch larger than N refused."""

from __future__ import annotations

import dataclasses

import pytest

from vip_core.config import ConfigError, get_preset, with_overrides
from vip_core.privacy.accounting import compute_epsilon
from vip_core.privacy.plan import plan_privacy

PAPER_N = 233_804_767


def test_paper_preset_gets_sigma_calibrated_to_epsilon_eight_for_the_measured_size():
    config = get_preset("vip-base-paper")
    assert config.privacy.noise_multiplier is None  # not typed in
    plan = plan_privacy(config, PAPER_N)
    assert plan.sample_rate == pytest.approx(98_304 / PAPER_N)
    assert plan.delta == pytest.approx(1 / (2 * PAPER_N))
    assert plan.steps == 6_000 and plan.max_grad_norm == 0.1 and plan.target_epsilon == 8.0
    assert 7.9 < plan.epsilon <= 8.0
    assert plan.epsilon == compute_epsilon(noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate,
                                           steps=plan.steps, delta=plan.delta, accountant=plan.accountant)
    assert 0.44 < plan.noise_multiplier < 0.48


def test_a_larger_dataset_needs_less_noise():
    config = with_overrides(get_preset("tiny"), {"private.steps": 50})
    small, large = plan_privacy(config, 1_000), plan_privacy(config, 10_000)
    assert large.noise_multiplier < small.noise_multiplier
    assert small.epsilon <= 8.0 and large.epsilon <= 8.0


def test_batch_larger_than_dataset_fails_naming_the_field():
    config = get_preset("tiny")
    with pytest.raises(ConfigError, match=r"private\.batch_size"):
        plan_privacy(config, config.private.batch_size - 1)


def test_configured_sigma_and_delta_are_used():
    config = with_overrides(get_preset("tiny"), {"privacy.noise_multiplier": 2.0, "privacy.delta": 1e-6})
    plan = plan_privacy(config, 1_000)
    assert plan.noise_multiplier == 2.0 and plan.delta == 1e-6
    assert plan.epsilon == compute_epsilon(noise_multiplier=2.0, sample_rate=64 / 1_000, steps=10, delta=1e-6)


def test_configured_sigma_that_overspends_the_budget_is_refused():
    config = with_overrides(get_preset("tiny"), {"privacy.noise_multiplier": 0.3})
    with pytest.raises(ConfigError, match=r"privacy\.noise_multiplier"):
        plan_privacy(config, 1_000)


def test_plan_is_frozen_and_disabled_privacy_has_none():
    plan = plan_privacy(get_preset("tiny"), 1_000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.noise_multiplier = 0.0
    with pytest.raises(ConfigError, match=r"privacy\.enabled"):
        plan_privacy(with_overrides(get_preset("tiny"), {"privacy.enabled": False}), 1_000)
