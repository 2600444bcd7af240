"""Poisson sampling: independent inclusion with probability q (never above it), random batch sizes,
resumable streams."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from vip_core.privacy.randomness import RandomStream, inclusion_threshold
from vip_core.privacy.sampling import PoissonSampler


def stream(seed: int) -> RandomStream:
    return RandomStream(seed, 0, "sampling")


def test_each_example_is_included_with_probability_q_and_batch_sizes_are_binomial():
    n, q, steps = 200, 0.1, 400
    sampler = PoissonSampler(n, q, stream(0))
    counts = torch.zeros(n)
    sizes = []
    for _ in range(steps):
        indices = sampler.sample()
        assert indices.unique().numel() == indices.numel()
        counts[indices] += 1
        sizes.append(len(indices))
    sizes = torch.tensor(sizes, dtype=torch.float64)
    assert sizes.mean().item() == pytest.approx(n * q, rel=0.05)
    assert sizes.var().item() == pytest.approx(n * q * (1 - q), rel=0.2)
    rate = counts / steps  # each example's inclusion frequency: mean q, spread of a binomial
    assert rate.mean().item() == pytest.approx(q, rel=0.05)
    assert rate.std().item() == pytest.approx((q * (1 - q) / steps) ** 0.5, rel=0.25)


def test_inclusions_of_two_examples_are_independent():
    n, q, steps = 2, 0.5, 4000
    sampler = PoissonSampler(n, q, stream(1))
    both = sum(len(sampler.sample()) == 2 for _ in range(steps))
    assert both / steps == pytest.approx(q * q, abs=0.03)


def test_a_logical_batch_can_be_empty():
    sampler = PoissonSampler(10, 0.01, stream(2))
    assert any(len(sampler.sample()) == 0 for _ in range(50))


def test_resuming_from_state_dict_continues_the_same_stream():
    sampler = PoissonSampler(100, 0.2, stream(3))
    for _ in range(3):
        sampler.sample()
    state = sampler.state_dict()
    expected = [sampler.sample() for _ in range(3)]
    resumed = PoissonSampler(100, 0.2, stream(123))
    resumed.load_state_dict(state)
    assert resumed.steps_drawn == 3
    assert all(torch.equal(a, b) for a, b in zip(expected, (resumed.sample() for _ in range(3))))


def test_state_for_another_rate_is_refused():
    state = PoissonSampler(100, 0.2, stream(0)).state_dict()
    with pytest.raises(ValueError, match="sample_rate"):
        PoissonSampler(100, 0.3, stream(0)).load_state_dict(state)


@pytest.mark.parametrize(("n", "q"), [(0, 0.1), (10, 0.0), (10, 1.5)])
def test_bad_settings_are_refused(n, q):
    with pytest.raises(ValueError):
        PoissonSampler(n, q, stream(0))


class FixedBits(RandomStream):
    """A stream whose 64-bit draws are given: to test the comparison itself."""

    def __init__(self, bits: list[int]) -> None:
        super().__init__(0, 0, "sampling")
        self.values = np.array(bits, dtype=np.uint64)

    def bits(self, count: int) -> np.ndarray:
        return self.values[:count]


@pytest.mark.parametrize("q", [98_304 / 233_804_767, 0.1, 1 / 3, 1.5 * 2.0**-24, 1e-12, 1.0])
def test_an_example_is_included_with_probability_q_to_within_two_to_the_minus_64_never_above(q):
    threshold = inclusion_threshold(q)
    assert Fraction(threshold, 2**64) <= Fraction(q)  # never above the q the accountant is fed
    assert Fraction(q) - Fraction(threshold, 2**64) < Fraction(1, 2**64)
    if threshold < 2**64:  # the draw just below the threshold is in, the draw at it is out
        assert FixedBits([threshold - 1, threshold]).poisson_indices(2, q).tolist() == ([0] if threshold else [])
