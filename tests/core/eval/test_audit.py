"""Auditing in one run (Steinke, Nasr and Jagielski, 2023): the bound's statistics, and its power and
soundness on real training runs through the DP engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from vip_core.config import get_preset, with_overrides
from vip_core.eval.audit import (
    audit, audit_p_value, default_delta, epsilon_lower_bound, guess_and_bound, train_with_canaries,
)
from vip_core.train.schedule import Schedule


@pytest.mark.parametrize(
    ("m", "r", "v", "delta", "published"),
    [
        (1000, 100, 75, 1e-4, 0.673),  # arXiv:2305.08846v1, Appendix D
        (100_000, 1510, 1439, 1e-5, 2.675),  # arXiv:2305.08846v1, Section 7 (Figure 11)
    ],
)
def test_lower_bound_reproduces_the_papers_printed_values(m, r, v, delta, published):
    bound = epsilon_lower_bound(canaries=m, guesses=r, correct=v, delta=delta, confidence=0.95)
    assert bound == pytest.approx(published, abs=1e-3)


def test_pure_dp_p_value_is_the_binomial_tail():
    p = audit_p_value(canaries=500, guesses=200, correct=150, epsilon=1.0, delta=0.0)
    assert p == pytest.approx(stats.binom.sf(149, 200, math.e / (1 + math.e)))


def test_p_value_grows_with_the_null_epsilon_and_delta_only_adds():
    values = [audit_p_value(canaries=1000, guesses=300, correct=200, epsilon=e, delta=1e-5) for e in (0.5, 0.7, 1)]
    assert values[0] < values[1] < values[2] <= 1.0
    pure = audit_p_value(canaries=1000, guesses=300, correct=200, epsilon=0.7, delta=0.0)
    assert audit_p_value(canaries=1000, guesses=300, correct=200, epsilon=0.7, delta=1e-3) > pure


def test_no_correct_guesses_prove_nothing():
    assert epsilon_lower_bound(canaries=100, guesses=10, correct=0, delta=1e-5) == 0.0
    with pytest.raises(ValueError, match="correct <= guesses <= canaries"):
        epsilon_lower_bound(canaries=10, guesses=20, correct=5, delta=1e-5)


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0])
def test_bound_is_sound_on_randomized_response(epsilon):
    # ε-DP randomized response on each canary's membership bit: the audit must not exceed ε.
    rng = np.random.default_rng(int(epsilon * 10))
    included = rng.random(1000) < 0.5
    truthful = rng.random(1000) < math.exp(epsilon) / (1 + math.exp(epsilon))
    reported = np.where(truthful, included, ~included)
    scores = reported + 0.01 * rng.random(1000)  # the reported bit, ties broken at random
    bound = guess_and_bound(scores, included, delta=0.0)
    assert 0 < bound.epsilon_lower_bound <= epsilon


def test_perfect_guesses_give_a_large_bound_and_random_scores_a_small_one():
    rng = np.random.default_rng(0)
    included = rng.random(1000) < 0.5
    perfect = guess_and_bound(included.astype(float), included, delta=1e-5)
    assert perfect.correct_guesses == perfect.guesses and perfect.epsilon_lower_bound > 4
    blind = guess_and_bound(rng.random(1000), included, delta=1e-5)
    assert blind.epsilon_lower_bound < 0.5


AUDIT_CONFIG = get_preset("tiny")  # the preset as it is: the audit's default δ must give the bound power


def test_the_default_delta_leaves_the_bound_its_power():
    assert AUDIT_CONFIG.privacy.delta is None
    for canaries in (100, 1000, 100_000):
        assert 2 * canaries * default_delta(canaries) <= 0.02
    # The pre-training default 1/(2N) on the audit's 564 examples makes 2·m·δ exceed 1: 46 right of 50 guesses,
    # what a private tiny run gives, then prove nothing.
    assert epsilon_lower_bound(canaries=1000, guesses=50, correct=46, delta=1 / (2 * 564)) == 0.0
    assert epsilon_lower_bound(canaries=1000, guesses=50, correct=46, delta=default_delta(1000)) > 1.0


def test_audit_of_a_non_private_run_has_power():
    result = audit(with_overrides(AUDIT_CONFIG, {"privacy.enabled": False}), 1000)
    assert result["epsilon_claimed"] is None and result["noise_multiplier"] == 0.0
    assert result["epsilon_lower_bound"] >= 3.0
    assert result["correct_guesses"] <= result["guesses"] <= 1000 and result["delta"] == 1e-5


def test_audit_of_a_dp_run_stays_below_the_claimed_epsilon_and_trains_the_recipes_schedule():
    config = with_overrides(AUDIT_CONFIG, {"privacy.target_epsilon": 2.0})
    run = train_with_canaries(config, 1000)
    assert run.learning_rates == tuple(Schedule.of(config.private).lr(t) for t in range(config.private.steps))
    assert len(set(run.learning_rates)) > 2  # the warmup and the cosine, not one constant rate
    result = audit(config, 1000)
    assert 1.9 < result["epsilon_claimed"] <= 2.0 and result["noise_multiplier"] > 0
    assert result["epsilon_lower_bound"] <= 2.0
    assert result["canaries"] == 1000 and result["delta"] == default_delta(1000)
