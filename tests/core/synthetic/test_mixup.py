"""Mixup: a convex combination of images with weights that sum to one."""

from __future__ import annotations

import numpy as np
import pytest

from vip_core.synthetic.mixup import convex_mix, mixup_weights


def test_convex_mixup():
    rng = np.random.default_rng(0)
    weights = mixup_weights(rng, 6)
    assert weights.shape == (6,) and np.all(weights >= 0) and weights.sum() == pytest.approx(1.0)
    images = [np.full((4, 4, 3), value, dtype=np.uint8) for value in (0, 100, 200)]
    mixed = convex_mix(images, np.array([0.5, 0.25, 0.25]))
    assert np.all(mixed == 75)
    with pytest.raises(ValueError, match="sum to 1"):
        convex_mix(images, np.array([0.5, 0.5, 0.5]))
