"""ViTDet's simple feature pyramid: multi-scale maps from the last feature map of a plain ViT.

The encoder's last block gives one map at stride p (the patch size). Deconvolutions make the 4x and 2x
finer maps, the map itself is the 1x level and a max-pool the 0.5x level (Li et al. 2022, "Exploring
Plain Vision Transformer Backbones for Object Detection"); each level is then projected to
``out_channels`` by a 1x1 and a 3x3 convolution with LayerNorm. With p = 16 the levels have strides
4, 8, 16, 32 like a ResNet FPN.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

SCALES = (4.0, 2.0, 1.0, 0.5)


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a ``[N, C, H, W]`` map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # [N, C, H, W]


def _resample(dim: int, scale: float) -> tuple[nn.Module, int]:
    if scale == 4.0:
        return nn.Sequential(nn.ConvTranspose2d(dim, dim // 2, 2, stride=2), LayerNorm2d(dim // 2), nn.GELU(),
                             nn.ConvTranspose2d(dim // 2, dim // 4, 2, stride=2)), dim // 4
    if scale == 2.0:
        return nn.ConvTranspose2d(dim, dim // 2, 2, stride=2), dim // 2
    if scale == 1.0:
        return nn.Identity(), dim
    return nn.MaxPool2d(2), dim


class SimpleFeaturePyramid(nn.Module):
    """A ViT encoder followed by the simple pyramid; ``forward`` returns ``{"0": finest, ..., "pool": ...}``.

    The ``"pool"`` level (stride 2x the coarsest) is the max-pooled coarsest map, as torchvision's FPN
    adds it for the region proposal network. ``out_channels`` is what torchvision's detectors read.
    """

    def __init__(self, encoder: nn.Module, out_channels: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.out_channels = out_channels
        dim = encoder.embed_dim
        self.levels = nn.ModuleList()
        for scale in SCALES:
            resample, channels = _resample(dim, scale)
            self.levels.append(nn.Sequential(
                resample,
                nn.Conv2d(channels, out_channels, 1, bias=False), LayerNorm2d(out_channels),
                nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False), LayerNorm2d(out_channels),
            ))

    @property
    def strides(self) -> tuple[int, ...]:
        """Pixel strides of the levels ``"0"``..``"3"`` and ``"pool"``."""
        patch = self.encoder.patch_embed.patch_size[0]
        return tuple(int(patch / scale) for scale in SCALES) + (int(patch / SCALES[-1]) * 2,)

    def forward(self, images: torch.Tensor) -> "OrderedDict[str, torch.Tensor]":
        (last,) = self.encoder.forward_intermediates(images, indices=1, output_fmt="NCHW",
                                                     intermediates_only=True)  # [N, D, H/p, W/p]
        maps = OrderedDict((str(i), level(last)) for i, level in enumerate(self.levels))
        maps["pool"] = nn.functional.max_pool2d(maps[str(len(SCALES) - 1)], 1, stride=2)
        return maps


def resize_encoder(encoder: nn.Module, img_size: int) -> nn.Module:
    """The encoder set to ``img_size`` square inputs (position embeddings resampled when the grid changes)."""
    if tuple(encoder.patch_embed.img_size) != (img_size, img_size):
        encoder.set_input_size(img_size=(img_size, img_size))
    return encoder
