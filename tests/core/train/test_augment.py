"""The pre-training augmentation: torchvision's random resized crop (area 0.2-1, aspect 3/4-4/3) and a flip,
drawn per sample from a stream and applied per sample on the device."""

from __future__ import annotations

import math

import pytest
import torch

from vip_core.config import TrainingConfig, get_preset
from vip_core.privacy.randomness import RandomStream
from vip_core.train.augment import CROP_DRAWS, TRIES, apply_crop_flips, crop_flips_from, draw_crop_flips

SCALE, RATIO = (0.2, 1.0), (3 / 4, 4 / 3)


def crops(count: int, seed: int = 0) -> torch.Tensor:
    return draw_crop_flips(RandomStream(seed, 0, "sample"), count, scale=SCALE, ratio=RATIO)  # [count, 5]


def images(count: int, size: int = 16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (count, 3, size, size), generator=generator).float()  # [count, 3, S, S]


def test_every_crop_covers_a_fifth_to_all_of_the_image_and_lies_inside_it():
    left, top, width, height, _ = crops(4000).unbind(1)
    area = width * height
    assert area.min() >= 0.2 - 1e-6 and area.max() <= 1.0 + 1e-6
    assert (left >= 0).all() and (top >= 0).all()
    assert (left + width <= 1 + 1e-6).all() and (top + height <= 1 + 1e-6).all()
    aspect = width / height
    fitted = area < 1 - 1e-6
    assert aspect[fitted].min() >= 3 / 4 - 1e-4 and aspect[fitted].max() <= 4 / 3 + 1e-4


def test_a_flip_happens_about_half_the_time():
    count = 4000
    flips = crops(count)[:, 4]
    assert set(flips.tolist()) == {0.0, 1.0}
    assert abs(flips.mean().item() - 0.5) < 4 * math.sqrt(0.25 / count)


def test_the_first_try_that_fits_is_kept_and_the_whole_image_when_none_does():
    draws = torch.full((2, CROP_DRAWS), 0.5)
    draws[0, 0:4] = torch.tensor([1.0, 1.0, 0.0, 0.0])  # area 1 at aspect 4/3: too wide, rejected
    draws[0, 4:8] = torch.tensor([0.0, 0.5, 0.0, 1.0])  # area 0.2, aspect 1: fits, at the left, at the bottom
    draws[1, :-1] = torch.tensor([1.0, 1.0, 0.5, 0.5]).repeat(TRIES)  # never fits
    boxes = crop_flips_from(draws, scale=SCALE, ratio=RATIO)
    side = math.sqrt(0.2)
    assert boxes[0].tolist() == pytest.approx([0.0, 1 - side, side, side, 0.0], abs=1e-6)
    assert boxes[1].tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0, 0.0])


def test_the_whole_image_unflipped_is_the_image_and_flipped_its_mirror():
    pixels = images(2)
    whole = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0, 1.0]])
    out = apply_crop_flips(pixels, whole)
    assert torch.allclose(out[0], pixels[0], atol=1e-3)
    assert torch.allclose(out[1], pixels[1].flip(-1), atol=1e-3)


def test_a_crop_is_resized_back_to_the_images_size_within_the_pixel_range():
    pixels = images(3)
    out = apply_crop_flips(pixels, crops(3))
    assert out.shape == pixels.shape
    assert out.min() >= 0 and out.max() <= 255
    corner = apply_crop_flips(pixels[:1], torch.tensor([[0.0, 0.0, 0.5, 0.5, 0.0]]))
    blocks = corner.reshape(1, 3, 8, 2, 8, 2).mean(dim=(3, 5))  # the 2x upsampled quarter, averaged back
    assert (blocks - pixels[:1, :, :8, :8]).abs().mean() < 20


def test_each_image_is_augmented_by_its_own_row_only():
    pixels, boxes = images(5), crops(5)
    together = apply_crop_flips(pixels, boxes)
    alone = torch.cat([apply_crop_flips(pixels[i:i + 1], boxes[i:i + 1]) for i in range(5)])
    assert torch.allclose(together, alone, atol=1e-4)
    changed = pixels.clone()
    changed[2] = 255 - changed[2]
    other = boxes.clone()
    other[2] = torch.tensor([0.1, 0.1, 0.5, 0.5, 1.0])
    moved = apply_crop_flips(changed, other)
    assert torch.equal(moved[[0, 1, 3, 4]], together[[0, 1, 3, 4]]) and not torch.equal(moved[2], together[2])


def test_the_paper_presets_crop_and_flip_and_the_cpu_presets_do_not():
    for name in ("vip-base", "vip-base-paper", "vip-large"):
        preset = get_preset(name)
        for stage in (preset.synthetic, preset.private):
            assert (stage.augmentation, stage.crop_scale, stage.crop_ratio) == ("rrc_flip", SCALE, RATIO)
    for name in ("tiny", "vip-pico"):
        preset = get_preset(name)
        assert preset.synthetic.augmentation == preset.private.augmentation == "none"


@pytest.mark.parametrize("field, value", [("crop_scale", (0.0, 1.0)), ("crop_scale", (0.5, 0.2)),
                                          ("crop_scale", (0.2, 1.5)), ("crop_ratio", (0.0, 1.0)),
                                          ("crop_ratio", (2.0, 1.0))])
def test_a_crop_range_out_of_order_or_bounds_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TrainingConfig(**{field: value})
