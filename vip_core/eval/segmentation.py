"""ADE20K semantic segmentation: the encoder, the simple feature pyramid and a light fusion head; mIoU.

The head upsamples the four pyramid levels to the finest one, sums them, applies a 3x3 convolution
with BatchNorm and ReLU and a 1x1 classifier; logits are upsampled bilinearly to the input. (This is a
light decoder, not the UperNet of the MAE/ViP papers' tables.) Training is end to end with AdamW and
layer-wise lr decay on the encoder, cross-entropy ignoring ADE20K's label 0. Evaluation upsamples the
logits to each label map's original size and reports mIoU over the classes that occur in the ground
truth or the predictions, and pixel accuracy. As one of several workers, each trains on its share of every
global batch and scores its block of the validation split; the confusion matrices are summed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vip_core.eval.datasets import (
    IGNORE_LABEL, SegmentationDataset, ade20k_pairs, ade20k_root, keyed_draws, segmentation_collate,
)
from vip_core.eval.fit import EpochCheckpoint, FitSettings, fit, layer_decay_adamw
from vip_core.eval.loading import EpochBatches, Loading, rank_block
from vip_core.eval.pyramid import SCALES, SimpleFeaturePyramid, resize_encoder
from vip_core.eval.seeding import job_seed, seeded
from vip_core.train.distributed import is_distributed


@dataclass(frozen=True, kw_only=True)
class SegmentationSettings(FitSettings):
    """Segmenter training: square ``img_size`` inputs, ``num_classes`` classes (ADE20K: 150)."""

    img_size: int
    channels: int
    num_classes: int


class Segmenter(nn.Module):
    """Pyramid levels upsampled to the finest, summed, 3x3 conv-BN-ReLU, 1x1 classifier."""

    def __init__(self, encoder: nn.Module, num_classes: int, channels: int) -> None:
        super().__init__()
        self.backbone = SimpleFeaturePyramid(encoder, channels)
        self.fuse = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU(inplace=True))
        self.classifier = nn.Conv2d(channels, num_classes, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        maps = self.backbone(images)
        finest = maps["0"]  # [N, C, 4H/p, 4W/p]
        fused = finest
        for level in range(1, len(SCALES)):
            fused = fused + nn.functional.interpolate(maps[str(level)], size=finest.shape[-2:], mode="bilinear",
                                                      align_corners=False)
        logits = self.classifier(self.fuse(fused))  # [N, K, 4H/p, 4W/p]
        return nn.functional.interpolate(logits, size=images.shape[-2:], mode="bilinear", align_corners=False)


def train_segmenter(model: Segmenter, dataset: SegmentationDataset, settings: SegmentationSettings, loading: Loading,
                    checkpoint: EpochCheckpoint | None = None) -> Segmenter:
    """End-to-end training for ``settings.epochs`` epochs; returns the model in eval mode."""
    sampler = EpochBatches(len(dataset), settings.batch_size, seed=settings.seed, name="segmentation order",
                           drop_last=len(dataset) > settings.batch_size)
    optimizer = layer_decay_adamw(model, "backbone.encoder.", lr=settings.lr, weight_decay=settings.weight_decay,
                                  layer_decay=settings.layer_decay)
    model.to(loading.device)

    def loss_of(batch: tuple[torch.Tensor, list[torch.Tensor]]) -> torch.Tensor:
        images, labels = batch
        logits = model(loading.to_device(images))  # [N, K, S, S]
        return nn.functional.cross_entropy(logits, loading.to_device(torch.stack(labels)), ignore_index=IGNORE_LABEL)

    fit(model, optimizer, loading.epochs(dataset, sampler, segmentation_collate), loss_of, epochs=settings.epochs,
        steps_per_epoch=len(sampler), name="segmentation", checkpoint=checkpoint)
    return model.eval()


def confusion_matrix(predicted: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``[K, K]`` counts, rows the true class, ignoring :data:`IGNORE_LABEL` pixels."""
    keep = labels != IGNORE_LABEL
    index = labels[keep] * num_classes + predicted[keep]
    return torch.bincount(index, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def miou_from_confusion(confusion: torch.Tensor) -> dict[str, float]:
    """mIoU over classes present in the ground truth or the predictions, and pixel accuracy."""
    confusion = confusion.double()
    intersection = confusion.diag()
    union = confusion.sum(0) + confusion.sum(1) - intersection
    present = union > 0
    iou = intersection[present] / union[present]
    total = confusion.sum()
    return {"miou": iou.mean().item() if present.any() else 0.0,
            "pixel_accuracy": (intersection.sum() / total).item() if total > 0 else 0.0,
            "classes_scored": float(present.sum().item())}


@torch.no_grad()
def evaluate_segmenter(model: Segmenter, dataset: SegmentationDataset, batch_size: int,
                       loading: Loading) -> dict[str, float]:
    """mIoU and pixel accuracy at each label map's original resolution (this worker's block, summed over workers)."""
    model.to(loading.device).eval()
    num_classes = dataset.num_classes
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    for images, labels in loading.in_order(rank_block(dataset), batch_size, segmentation_collate):
        logits = model(loading.to_device(images)).float().cpu()  # [N, K, S, S]
        for one, truth in zip(logits, labels):
            full = nn.functional.interpolate(one[None], size=truth.shape, mode="bilinear", align_corners=False)
            confusion += confusion_matrix(full[0].argmax(0), truth, num_classes)  # truth: [H, W]
    if is_distributed():
        torch.distributed.all_reduce(confusion)
    return miou_from_confusion(confusion)


def segmentation_eval(encoder: nn.Module, root: str | Path, settings: SegmentationSettings, loading: Loading,
                      checkpoint: EpochCheckpoint | None = None) -> dict[str, float]:
    """Trains a segmenter on ``root``'s training split and returns mIoU on its validation split."""
    root = ade20k_root(root)
    train = SegmentationDataset(ade20k_pairs(root, "train"), settings.img_size, settings.num_classes,
                                draws=keyed_draws(settings.seed, "flips"))
    val = SegmentationDataset(ade20k_pairs(root, "val"), settings.img_size, settings.num_classes)
    with seeded(job_seed(settings.seed, "head")):
        model = Segmenter(resize_encoder(encoder, settings.img_size), settings.num_classes, settings.channels)
    train_segmenter(model, train, settings, loading, checkpoint)
    return evaluate_segmenter(model, val, settings.batch_size, loading)
