"""Pre-training augmentation: a random resized crop and a horizontal flip per sample, applied on the device.

The official MAE and ViP pre-training scripts augment with torchvision's
``RandomResizedCrop(224, scale=(0.2, 1.0), interpolation=bicubic)`` then ``RandomHorizontalFlip()``. Here the
draws are made in the step's batch function from the step's per-sample stream, one row of uniforms per sample
(:func:`draw_crop_flips`), beside the masks: a private run's fresh-entropy stream, the synthetic stage's
seeded one. The images arrive decoded as square uint8 tensors; :func:`apply_crop_flips` crops and resizes
every image back to its size through its own affine grid (bicubic ``grid_sample``) on the model's device.
Each sample's augmented image depends on that sample's pixels and its own row of draws only (rule 4).

The crop follows torchvision's rejection sampling: up to ``TRIES`` draws of an area fraction in ``scale`` and a
log-uniform aspect ratio in ``ratio``, the first that fits the image kept, the whole image when none does
(torchvision's fallback on a square image). Boxes are continuous (torchvision rounds them to pixels).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

TRIES = 10
CROP_DRAWS = 4 * TRIES + 1  # per try: area, aspect, left, top; then the flip


class Uniforms(Protocol):
    """A source of uniform draws in [0, 1) (a :class:`~vip_core.privacy.randomness.RandomStream`)."""

    def uniform(self, shape: tuple[int, ...]) -> torch.Tensor: ...


def draw_crop_flips(stream: Uniforms, count: int, *, scale: tuple[float, float],
                    ratio: tuple[float, float]) -> torch.Tensor:
    """``count`` crop boxes and flips ``[count, 5]``: left, top, width, height (fractions of a square image's
    side) and flip (1.0 or 0.0), each row from that sample's own ``CROP_DRAWS`` uniforms."""
    return crop_flips_from(stream.uniform((count, CROP_DRAWS)), scale=scale, ratio=ratio)


def crop_flips_from(draws: torch.Tensor, *, scale: tuple[float, float], ratio: tuple[float, float]) -> torch.Tensor:
    """The boxes and flips ``[k, 5]`` that the uniforms ``draws`` ``[k, CROP_DRAWS]`` select, row by row."""
    tries = draws[:, :-1].reshape(len(draws), TRIES, 4).double()  # [k, TRIES, 4]
    area = scale[0] + (scale[1] - scale[0]) * tries[..., 0]  # [k, TRIES]
    log_ratio = (math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * tries[..., 1]).exp()  # [k, TRIES]
    width, height = (area * log_ratio).sqrt(), (area / log_ratio).sqrt()  # [k, TRIES] each
    fits = (width <= 1.0) & (height <= 1.0)  # [k, TRIES]
    first = fits.double().argmax(dim=1, keepdim=True)  # [k, 1]: the first try that fits (0 when none does)
    found = fits.any(dim=1)  # [k]
    width = torch.where(found, _pick(width, first), 1.0)  # [k]
    height = torch.where(found, _pick(height, first), 1.0)  # [k]
    left = _pick(tries[..., 2], first) * (1.0 - width)  # [k]
    top = _pick(tries[..., 3], first) * (1.0 - height)  # [k]
    flip = (draws[:, -1] < 0.5).double()  # [k]
    return torch.stack([left, top, width, height, flip], dim=1).float()  # [k, 5]


def _pick(values: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    return values.gather(1, first).squeeze(1)  # values: [k, TRIES], first: [k, 1] -> [k]


def apply_crop_flips(images: torch.Tensor, crops: torch.Tensor) -> torch.Tensor:
    """Each image ``[b, 3, S, S]`` (float, 0..255) cropped to its box of ``crops`` ``[b, 5]``, resized back to
    ``S`` × ``S`` bicubically and flipped where its flip is 1; the values stay within 0..255."""
    left, top, width, height, flip = crops.to(images.device, torch.float32).unbind(dim=1)  # each [b]
    theta = torch.zeros(len(images), 2, 3, device=images.device)  # [b, 2, 3]: output grid -> input coordinates
    theta[:, 0, 0] = width * (1.0 - 2.0 * flip)
    theta[:, 0, 2] = 2.0 * left + width - 1.0
    theta[:, 1, 1] = height
    theta[:, 1, 2] = 2.0 * top + height - 1.0
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)  # [b, S, S, 2]
    resized = F.grid_sample(images, grid, mode="bicubic", padding_mode="border", align_corners=False)
    return resized.clamp_(0.0, 255.0)  # [b, 3, S, S]
