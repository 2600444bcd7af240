"""Convex mixup of rendered images (Shaders21k-MixUp: each image is a weighted mean of K images).

The weights are drawn from a flat Dirichlet distribution, so every convex combination of the K images is
equally likely; K = 6 is the paper's Shaders21k-6mixup.
"""

from __future__ import annotations

import numpy as np


def mixup_weights(rng: np.random.Generator, k: int) -> np.ndarray:
    """K convex weights (non-negative, summing to 1) from a flat Dirichlet: [K] float64."""
    if k < 1:
        raise ValueError(f"mixup needs at least one image, got k={k}")
    return rng.dirichlet(np.ones(k))


def convex_mix(images: list[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """The weighted mean of ``images`` (each [H, W, 3] uint8) with convex ``weights`` ([K]).

    Returns:
        mixed: [H, W, 3] uint8, rounded to nearest.
    """
    if len(images) != len(weights):
        raise ValueError(f"{len(images)} images but {len(weights)} weights")
    if np.any(weights < 0) or not np.isclose(weights.sum(), 1.0):
        raise ValueError(f"mixup weights must be non-negative and sum to 1, got {weights.tolist()}")
    stack = np.stack(images).astype(np.float64)  # [K, H, W, 3]
    mixed = np.tensordot(weights, stack, axes=1)  # [H, W, 3]
    return np.clip(np.rint(mixed), 0, 255).astype(np.uint8)

