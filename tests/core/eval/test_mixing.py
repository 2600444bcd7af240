"""Fine-tuning's regularisers (MAE's recipe): label smoothing, mixup and cutmix drawn from the job's own seeded
generator, and per-sample drop path that is active in training only."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from vip_core.config import EVAL_TASK_FIELDS, get_preset, tiny
from vip_core.eval.datasets import uniform_from
from vip_core.eval.mixing import DropPath, mix_batch, set_drop_path, soft_cross_entropy, soft_targets
from vip_core.eval.seeding import numpy_generator
from vip_core.models import build_encoder

RECIPE = ("finetune_drop_path", "finetune_label_smoothing", "finetune_mixup", "finetune_cutmix", "finetune_randaugment")


def batch(count: int = 6, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(count, 3, 8, 8, generator=generator)  # [N, 3, 8, 8]
    return images, soft_targets(torch.arange(count) % classes, classes, 0.1)  # [N, C]


def test_smoothed_targets_put_one_minus_s_plus_s_over_c_on_the_label_and_match_torchs_smoothed_loss():
    labels = torch.tensor([0, 2, 1])
    targets = soft_targets(labels, 4, 0.1)
    assert targets.sum(1).tolist() == pytest.approx([1.0] * 3)
    assert targets[0].tolist() == pytest.approx([0.925, 0.025, 0.025, 0.025])
    logits = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    expected = nn.functional.cross_entropy(logits, labels, label_smoothing=0.1, reduction="none")
    assert torch.allclose(soft_cross_entropy(logits, targets), expected, atol=1e-6)
    confident = torch.tensor([[20.0, 0.0, 0.0, 0.0]])
    plain = nn.functional.cross_entropy(confident, labels[:1])
    smoothed = nn.functional.cross_entropy(confident, labels[:1], label_smoothing=0.1)
    assert plain < 1e-6 < smoothed  # a confident right answer still costs something under smoothing


@pytest.mark.parametrize("mixup, cutmix", [(0.8, 0.0), (0.0, 1.0), (0.8, 1.0)])
def test_mixup_and_cutmix_draws_are_the_same_for_one_seed_and_differ_for_another(mixup, cutmix):
    images, targets = batch()

    def mixed(seed: int) -> list[torch.Tensor]:
        rng = numpy_generator(seed, "finetune", "mixup")
        return [tensor for _ in range(4) for tensor in mix_batch(images, targets, mixup=mixup, cutmix=cutmix, rng=rng)]

    first, again, other = mixed(0), mixed(0), mixed(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    assert all(torch.allclose(t.sum(1), torch.ones(len(t))) for t in first[1::2])  # soft targets stay distributions


def test_mixup_mixes_each_image_with_the_reversed_batch_by_the_same_weight_as_its_targets():
    images, targets = batch()
    out, mixed = mix_batch(images, targets, mixup=0.8, cutmix=0.0, rng=numpy_generator(0, "mixup"))
    other = targets.flip(0)[0]  # the targets image 0 is mixed with (another label)
    lam = float((mixed[0, 0] - other[0]) / (targets[0, 0] - other[0]))
    assert torch.allclose(out, lam * images + (1 - lam) * images.flip(0), atol=1e-6)


def test_cutmix_pastes_a_box_of_the_reversed_batch_and_weighs_the_targets_by_the_area_left():
    images, targets = batch()
    out, mixed = mix_batch(images, targets, mixup=0.0, cutmix=1.0, rng=numpy_generator(3, "mixup"))
    pasted = (out != images).any(dim=1)[0]  # [8, 8]: where image 0 took the last image's pixels
    lam = 1.0 - pasted.float().mean().item()
    assert torch.allclose(mixed, lam * targets + (1 - lam) * targets.flip(0), atol=1e-6)
    assert torch.equal(out[0][:, pasted], images[-1][:, pasted])


def test_without_mixup_or_cutmix_the_batch_is_unchanged():
    images, targets = batch()
    out, same = mix_batch(images, targets, mixup=0.0, cutmix=0.0, rng=numpy_generator(0, "mixup"))
    assert out is images and same is targets


def test_drop_path_rises_linearly_over_the_blocks_and_is_active_in_training_only():
    encoder = build_encoder(tiny().model)
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    encoder.eval()
    with torch.no_grad():
        reference = encoder.forward_features(images)  # [8, P + L, D]
    set_drop_path(encoder, 0.5, uniform_from(torch.Generator().manual_seed(0)))
    rates = [(block.drop_path1.rate, block.drop_path2.rate) for block in encoder.blocks]
    assert rates == [(0.0, 0.0), (0.5, 0.5)]  # tiny has two blocks
    with torch.no_grad():
        assert torch.equal(encoder.eval().forward_features(images), reference)
        trained = encoder.train().forward_features(images)
    changed = (trained - reference).flatten(1).abs().amax(1) > 1e-5  # [8]
    assert 0 < int(changed.sum()) <= 8  # some samples lost a branch


def test_drop_path_keeps_each_sample_with_probability_one_minus_the_rate_from_its_own_draw():
    drop = DropPath(0.3, uniform_from(torch.Generator().manual_seed(0))).train()
    count = 4000
    out = drop(torch.ones(count, 2, 3))  # [count, 2, 3]
    kept = out[:, 0, 0] > 0
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / 0.7)) and (out[~kept] == 0).all()
    assert abs(kept.float().mean().item() - 0.7) < 4 * math.sqrt(0.21 / count)
    assert (out == out[:, :1, :1]).all()  # one draw per sample, over all its tokens
    again = DropPath(0.3, uniform_from(torch.Generator().manual_seed(0))).train()(torch.ones(count, 2, 3))
    assert torch.equal(out, again)
    with pytest.raises(ValueError, match=r"drop path rate must lie in \[0, 1\)"):
        DropPath(1.0, uniform_from(torch.Generator()))


def test_the_paper_presets_follow_the_official_evaluation_recipes_and_tiny_keeps_its_own():
    for name in ("vip-base", "vip-base-paper", "vip-large"):
        preset = get_preset(name)
        evaluation = preset.evaluation
        assert evaluation.linprobe_last_blocks == preset.model.depth
        assert (evaluation.linprobe_epochs, evaluation.linprobe_lr, evaluation.linprobe_optimizer) == (90, 0.1, "lars")
        assert evaluation.layer_decay == 0.65
        assert [getattr(evaluation, field) for field in RECIPE] == [0.1, 0.1, 0.8, 1.0, 9]
    assert [getattr(tiny().evaluation, field) for field in RECIPE] == [0.0, 0.0, 0.0, 0.0, 0]
    assert set(RECIPE) <= set(EVAL_TASK_FIELDS["finetune"])
