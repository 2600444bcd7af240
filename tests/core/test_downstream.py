"""The downstream tasks' generators: deterministic per seed, balanced, and learnable from raw pixels."""

import numpy as np
import pytest
import torch

from vip_core.data.downstream import TASK_KINDS, generate_task
from vip_core.eval.logistic import converged_probe


@pytest.mark.parametrize("kind", sorted(TASK_KINDS))
def test_a_seed_gives_the_same_images_and_another_seed_others(kind):
    images, labels = generate_task(kind, 50, seed=4)
    again, again_labels = generate_task(kind, 50, seed=4)
    other, _ = generate_task(kind, 50, seed=5)
    assert images.shape == (50, 32, 32, 3) and images.dtype == np.uint8 and labels.dtype == np.int64
    assert np.array_equal(images, again) and np.array_equal(labels, again_labels)
    assert not np.array_equal(images, other)
    assert images.std() > 10  # not blank


@pytest.mark.parametrize("kind", sorted(TASK_KINDS))
def test_every_class_is_drawn_about_equally_often(kind):
    _, labels = generate_task(kind, 1000, seed=0)
    counts = np.bincount(labels, minlength=len(TASK_KINDS[kind].classes))
    expected = 1000 / len(TASK_KINDS[kind].classes)
    assert len(counts) == len(TASK_KINDS[kind].classes) and np.all(np.abs(counts - expected) < 0.3 * expected)


@pytest.mark.parametrize("kind", sorted(TASK_KINDS))
def test_a_small_probe_on_raw_pixels_beats_chance(kind):
    images, labels = generate_task(kind, 1600, seed=3)
    pixels = torch.nn.functional.avg_pool2d(torch.tensor(images, dtype=torch.float32).permute(0, 3, 1, 2) / 255, 2)
    features = pixels.flatten(1)  # [N, 3 * 16 * 16]
    classes = len(TASK_KINDS[kind].classes)
    probe = converged_probe((features[:800], torch.tensor(labels[:800])), (features[800:], torch.tensor(labels[800:])),
                            classes, grid=(1e-2, 1e-1, 1.0), folds=2)
    chance = 1 / classes
    assert probe.top1 > chance + 3 * (chance * (1 - chance) / 800) ** 0.5, (kind, probe.top1)  # 3 sd above chance


def test_an_unknown_task_or_a_negative_count_is_refused():
    with pytest.raises(ValueError, match="unknown kind 'digits'"):
        generate_task("digits", 10, 0)
    with pytest.raises(ValueError, match="count must be >= 0"):
        generate_task("textures", -1, 0)
