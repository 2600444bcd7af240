"""Fine-tuning's regularisers from the official MAE recipe: label smoothing, mixup and cutmix, drop path.

* :func:`soft_targets` and :func:`mix_batch` follow timm's ``Mixup`` in ``batch`` mode as MAE's fine-tuning
  calls it (``mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, label_smoothing=0.1``): one λ per
  batch, each image mixed with the batch's image in reverse order, cutmix's λ corrected to the box's area.
  The draws come from the job's own numpy generator (:func:`vip_core.eval.seeding.numpy_generator`), not
  numpy's global one, so a public job is deterministic for its seed.
* :class:`DropPath` is timm's per-sample stochastic depth, its draws taken from a ``Uniform`` of the job's
  (a seeded generator for public fine-tuning, a fresh-entropy stream for DP fine-tuning);
  :func:`set_drop_path` puts it in every block at rates rising linearly from 0 to the last block's, as timm's
  ``drop_path_rate`` does.

Mixup and cutmix mix two samples into one: per-sample clipping would no longer bound one example's
contribution, so DP fine-tuning leaves them off (docs/privacy.md).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vip_core.eval.datasets import Uniform

SWITCH_PROB = 0.5  # with both on: cutmix for half of the batches, as timm's default


def soft_targets(labels: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """Smoothed one-hot targets ``[N, C]`` of ``labels`` ``[N]``: 1 - s + s/C on the label, s/C elsewhere."""
    off = smoothing / num_classes
    targets = torch.full((len(labels), num_classes), off, device=labels.device)  # [N, C]
    return targets.scatter_(1, labels.view(-1, 1), 1.0 - smoothing + off)


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy ``[N]`` of ``logits`` ``[N, C]`` against soft ``targets`` ``[N, C]``."""
    return -(targets * logits.log_softmax(dim=-1)).sum(dim=-1)  # [N]


def mix_batch(images: torch.Tensor, targets: torch.Tensor, *, mixup: float, cutmix: float,
              rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixup or cutmix of ``images`` ``[N, 3, S, S]`` and soft ``targets`` ``[N, C]`` with the batch reversed.

    ``mixup`` and ``cutmix`` are the α of their Beta(α, α) draws of λ (0: off); with both on, cutmix is chosen
    for a batch with probability 1/2. Returns the batch unchanged when both are off.
    """
    if mixup <= 0 and cutmix <= 0:
        return images, targets
    use_cutmix = cutmix > 0 and (mixup <= 0 or rng.random() < SWITCH_PROB)
    lam = float(rng.beta(cutmix, cutmix) if use_cutmix else rng.beta(mixup, mixup))
    if use_cutmix:
        images, lam = _cutmix(images, lam, rng)
    else:
        images = images * lam + images.flip(0) * (1.0 - lam)  # [N, 3, S, S]
    return images, targets * lam + targets.flip(0) * (1.0 - lam)  # [N, 3, S, S], [N, C]


def _cutmix(images: torch.Tensor, lam: float, rng: np.random.Generator) -> tuple[torch.Tensor, float]:
    """timm's ``rand_bbox``: a box of side ``sqrt(1 - λ)`` of the image's, centred anywhere and clipped, pasted
    from the reversed batch; λ becomes the share of the image left uncovered."""
    height, width = images.shape[-2:]
    cut_h, cut_w = int(height * np.sqrt(1.0 - lam)), int(width * np.sqrt(1.0 - lam))
    cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
    top, bottom = np.clip(cy - cut_h // 2, 0, height), np.clip(cy + cut_h // 2, 0, height)
    left, right = np.clip(cx - cut_w // 2, 0, width), np.clip(cx + cut_w // 2, 0, width)
    mixed = images.clone()  # [N, 3, S, S]
    mixed[:, :, top:bottom, left:right] = images.flip(0)[:, :, top:bottom, left:right]
    return mixed, 1.0 - float((bottom - top) * (right - left)) / (height * width)


class DropPath(nn.Module):
    """Stochastic depth per sample: in training, each sample's branch is kept with probability 1 - ``rate``
    (scaled by 1 / (1 - rate)), the keep draws from ``uniform``; the identity in evaluation."""

    def __init__(self, rate: float, uniform: Uniform) -> None:
        super().__init__()
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"drop path rate must lie in [0, 1), got {rate}")
        self.rate = rate
        self.uniform = uniform

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.rate == 0.0:
            return x
        keep = (self.uniform((len(x),)) >= self.rate).to(x.device, x.dtype)  # [N]
        return x * (keep / (1.0 - self.rate)).view(-1, *([1] * (x.ndim - 1)))  # [N, ...]

    def extra_repr(self) -> str:
        return f"rate={self.rate:.3f}"


def set_drop_path(encoder: nn.Module, rate: float, uniform: Uniform) -> None:
    """Puts :class:`DropPath` on both residual branches of every block of the timm ``encoder``, at rates rising
    linearly from 0 (first block) to ``rate`` (last block); a rate of 0 leaves the encoder as it is."""
    if rate == 0.0:
        return
    blocks = encoder.blocks
    for block, block_rate in zip(blocks, torch.linspace(0.0, rate, len(blocks)).tolist()):
        block.drop_path1 = DropPath(block_rate, uniform)
        block.drop_path2 = DropPath(block_rate, uniform)
