"""Paired statistics of two encoders scored on the same test examples, and the verdict on a finding.

Each arm of an experiment gives, per seed, whether each test example was classified right (``[S, N]``
booleans, the same N examples in the same order for every arm). An arm's accuracy and the difference of
two arms are averaged over the seeds per example, and their 95 % confidence intervals come from a
bootstrap over the test examples (the pairs stay together, so what both arms get right or wrong cancels).
The intervals cover the test set's sampling with the seeds' encoders fixed; the spread over seeds is
reported beside them (:func:`per_seed`).

A finding "A beats B" is decided from the interval of A - B against a margin fixed in advance:
``reproduced`` when the whole interval lies above the margin, ``not reproduced`` when it lies below,
``inconclusive`` when it contains the margin.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean and its two-sided bootstrap confidence interval."""

    mean: float
    low: float
    high: float

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "low": self.low, "high": self.high}


def _by_seed(correct: np.ndarray) -> np.ndarray:
    """``[S, N]`` float correctness; a single seed's ``[N]`` becomes ``[1, N]``."""
    values = np.asarray(correct, dtype=np.float64)
    if values.ndim == 1:
        values = values[None]
    if values.ndim != 2 or values.shape[1] == 0:
        raise ValueError(f"correctness must be [seeds, examples] with examples > 0, got shape {values.shape}")
    return values


def bootstrap_interval(values: np.ndarray, resamples: int = 2000, seed: int = 0, level: float = LEVEL) -> Interval:
    """The mean over examples of ``values: [S, N]`` (seed-averaged per example) with a percentile bootstrap CI."""
    per_example = _by_seed(values).mean(axis=0)  # [N]
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(per_example), (resamples, len(per_example)))  # [R, N]
    means = per_example[draws].mean(axis=1)  # [R]
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return Interval(float(per_example.mean()), float(low), float(high))


def accuracy(correct: np.ndarray, resamples: int = 2000, seed: int = 0) -> Interval:
    """An arm's accuracy (mean over seeds and examples) with its CI."""
    return bootstrap_interval(_by_seed(correct), resamples, seed)


def paired_difference(correct_a: np.ndarray, correct_b: np.ndarray, resamples: int = 2000, seed: int = 0) -> Interval:
    """Accuracy of A minus accuracy of B, paired per seed and example, with its CI."""
    a, b = _by_seed(correct_a), _by_seed(correct_b)
    if a.shape != b.shape:
        raise ValueError(f"the two arms were scored on different examples: shapes {a.shape} and {b.shape}")
    return bootstrap_interval(a - b, resamples, seed)


def per_seed(correct: np.ndarray) -> list[float]:
    """The accuracy of each seed."""
    return [float(row.mean()) for row in _by_seed(correct)]


def verdict(difference: Interval, margin: float = 0.0) -> str:
    """``reproduced`` if the CI of A - B lies above ``margin``, ``not reproduced`` if below, else ``inconclusive``."""
    if difference.low > margin:
        return REPRODUCED
    if difference.high < margin:
        return NOT_REPRODUCED
    return INCONCLUSIVE
