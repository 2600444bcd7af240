import numpy as np
import pytest

from vip_core.eval.paired import (
    INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, Interval, accuracy, paired_difference, per_seed, verdict,
)


def test_verdict_is_inconclusive_when_the_interval_contains_the_margin():
    assert verdict(Interval(0.01, -0.02, 0.04)) == INCONCLUSIVE
    assert verdict(Interval(-0.012, -0.03, 0.005), margin=-0.01) == INCONCLUSIVE


def test_verdict_is_reproduced_above_and_not_reproduced_below_the_margin():
    assert verdict(Interval(0.05, 0.01, 0.09)) == REPRODUCED
    assert verdict(Interval(-0.05, -0.09, -0.01)) == NOT_REPRODUCED
    assert verdict(Interval(-0.005, -0.009, -0.001), margin=-0.01) == REPRODUCED
    assert verdict(Interval(-0.03, -0.05, -0.015), margin=-0.01) == NOT_REPRODUCED


def test_a_clearly_better_arm_gives_an_interval_above_zero_and_equal_arms_one_around_it():
    rng = np.random.default_rng(0)
    weak = rng.random((2, 2000)) < 0.4
    strong = weak | (rng.random((2, 2000)) < 0.3)
    better = paired_difference(strong, weak, resamples=500)
    assert better.low > 0.1 and verdict(better) == REPRODUCED
    same = paired_difference(weak, weak[:, rng.permutation(2000)], resamples=500)
    assert same.low < 0 < same.high and verdict(same) == INCONCLUSIVE
    assert verdict(paired_difference(weak, strong, resamples=500)) == NOT_REPRODUCED


def test_accuracy_averages_the_seeds_and_brackets_the_mean():
    correct = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=bool)
    interval = accuracy(correct, resamples=200)
    assert interval.mean == pytest.approx(0.375) and interval.low <= 0.375 <= interval.high
    assert per_seed(correct) == [0.5, 0.25]


def test_arms_scored_on_different_examples_are_refused():
    with pytest.raises(ValueError, match="different examples"):
        paired_difference(np.ones((1, 5), bool), np.ones((1, 6), bool))
