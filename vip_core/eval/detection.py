"""COCO detection (and instance masks when the annotations have them) with a plain ViT backbone.

The encoder feeds ViTDet's simple feature pyramid (:mod:`vip_core.eval.pyramid`), which feeds
torchvision's Faster R-CNN (boxes) or Mask R-CNN (boxes and masks). Images are resized to a square of
``img_size`` (the encoder's position embeddings are resampled to that grid); the detector is trained end
to end with AdamW and layer-wise lr decay on the encoder, and evaluated by pycocotools on the original
image coordinates: AP (IoU 0.50:0.95) and AP50 for boxes, and for masks when present. As one of several workers,
each trains on its share of every global batch and detects in its block of the validation split; rank 0 gathers
the detections and scores them (the other workers return no metrics).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torchvision.models.detection import FasterRCNN, MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.ops import MultiScaleRoIAlign

from vip_core.eval.datasets import (
    IMAGENET_MEAN, IMAGENET_STD, CocoDetectionDataset, coco_has_masks, coco_paths, detection_collate, read_coco_json,
)
from vip_core.eval.fit import EpochCheckpoint, FitSettings, fit, layer_decay_adamw
from vip_core.eval.loading import EpochBatches, Loading, rank_block
from vip_core.eval.pyramid import SimpleFeaturePyramid, resize_encoder
from vip_core.eval.seeding import job_seed, seeded
from vip_core.train.distributed import gather_objects, rank_and_world

logger = logging.getLogger(__name__)

LEVELS = ["0", "1", "2", "3"]
# sys.stdout is one for the process: one evaluation at a time redirects it (two at once could leave it redirected)
_STDOUT = threading.Lock()
# torchvision's proposal and RoI counts suit images of this side; smaller images get proportionally fewer.
DEFAULT_DETECTION_SIZE = 800


@dataclass(frozen=True, kw_only=True)
class DetectionSettings(FitSettings):
    """Detector training: square ``img_size`` inputs, pyramid width ``channels``, AdamW at ``lr``."""

    img_size: int
    channels: int
    weight_decay: float = 0.1


def build_detector(encoder: nn.Module, num_classes: int, with_masks: bool, settings: DetectionSettings) -> nn.Module:
    """Faster/Mask R-CNN on the simple pyramid; anchors are 8x each level's stride, as in torchvision's FPN.

    Proposal and sampled-RoI counts are torchvision's defaults scaled by the image area relative to
    800 px (never below 200 proposals / 64 RoIs), so small CPU runs do not spend their time on RoIAlign.
    """
    backbone = SimpleFeaturePyramid(resize_encoder(encoder, settings.img_size), settings.channels)
    anchors = AnchorGenerator(sizes=tuple((8 * stride,) for stride in backbone.strides),
                              aspect_ratios=((0.5, 1.0, 2.0),) * len(backbone.strides))
    representation = 4 * settings.channels
    area = min(1.0, (settings.img_size / DEFAULT_DETECTION_SIZE) ** 2)
    common = dict(
        rpn_pre_nms_top_n_train=max(200, int(2000 * area)), rpn_post_nms_top_n_train=max(100, int(2000 * area)),
        rpn_pre_nms_top_n_test=max(200, int(1000 * area)), rpn_post_nms_top_n_test=max(100, int(1000 * area)),
        box_batch_size_per_image=max(64, int(512 * area)),
        num_classes=None, min_size=settings.img_size, max_size=settings.img_size, size_divisible=settings.img_size,
        image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD), rpn_anchor_generator=anchors,
        box_roi_pool=MultiScaleRoIAlign(LEVELS, output_size=7, sampling_ratio=2),
        box_head=TwoMLPHead(settings.channels * 7 * 7, representation),
        box_predictor=FastRCNNPredictor(representation, num_classes + 1),
    )
    if not with_masks:
        return FasterRCNN(backbone, **common)
    return MaskRCNN(
        backbone, **common, mask_roi_pool=MultiScaleRoIAlign(LEVELS, output_size=14, sampling_ratio=2),
        mask_head=MaskRCNNHeads(settings.channels, [settings.channels] * 2, 1),
        mask_predictor=MaskRCNNPredictor(settings.channels, settings.channels, num_classes + 1),
    )


def train_detector(detector: nn.Module, dataset: CocoDetectionDataset, settings: DetectionSettings, loading: Loading,
                   checkpoint: EpochCheckpoint | None = None) -> nn.Module:
    """End-to-end training for ``settings.epochs`` epochs; returns the detector in eval mode."""
    sampler = EpochBatches(len(dataset), settings.batch_size, seed=settings.seed, name="detection order")
    optimizer = layer_decay_adamw(detector, "backbone.encoder.", lr=settings.lr, weight_decay=settings.weight_decay,
                                  layer_decay=settings.layer_decay)
    detector.to(loading.device)
    rank, _ = rank_and_world()
    steps = itertools.count()

    def loss_of(batch: tuple[list[torch.Tensor], list[dict]]) -> torch.Tensor:
        images, targets = batch
        draws = job_seed(settings.seed, "samplers", str(next(steps)), str(rank))
        with seeded(draws):  # torchvision's RPN and RoI samplers
            losses = detector([loading.to_device(image) for image in images],
                              [{key: loading.to_device(value) for key, value in target.items()} for target in targets])
        return sum(losses.values())

    def epoch_start(epoch: int) -> None:
        nonlocal steps
        steps = itertools.count(epoch * len(sampler))

    fit(detector, optimizer, loading.epochs(dataset, sampler, detection_collate), loss_of, epochs=settings.epochs,
        steps_per_epoch=len(sampler), name="detection", checkpoint=checkpoint, epoch_start=epoch_start)
    return detector.eval()


@torch.no_grad()
def predict_coco(detector: nn.Module, dataset: CocoDetectionDataset, batch_size: int,
                 loading: Loading) -> list[dict[str, Any]]:
    """Detections in COCO result format, in each image's original coordinates, of every worker's block."""
    from pycocotools import mask as mask_utils

    detector.to(loading.device).eval()
    block = rank_block(dataset)
    infos = iter([dataset.images[index] for index in getattr(block, "indices", range(len(dataset)))])
    results = []
    for images, _ in loading.in_order(block, batch_size, detection_collate):
        for output in detector([loading.to_device(image) for image in images]):
            results += _to_coco(output, next(infos), dataset, mask_utils)
    return [detection for part in gather_objects(results) for detection in part]


def _to_coco(output: dict[str, torch.Tensor], info: dict[str, Any], dataset: CocoDetectionDataset,
             mask_utils: Any) -> list[dict[str, Any]]:
    sx, sy = info["width"] / dataset.size, info["height"] / dataset.size
    boxes = output["boxes"].cpu() * torch.tensor([sx, sy, sx, sy])  # [K, 4] x0 y0 x1 y1, original frame
    masks = None
    if "masks" in output and len(output["masks"]):
        full = nn.functional.interpolate(output["masks"].float(), size=(info["height"], info["width"]),
                                         mode="bilinear", align_corners=False)  # [K, 1, H, W]
        masks = (full[:, 0] > 0.5).cpu().numpy().astype(np.uint8)  # [K, H, W]
    detections = []
    for k, (box, score, label) in enumerate(zip(boxes.tolist(), output["scores"].tolist(), output["labels"].tolist())):
        entry = {"image_id": info["id"], "category_id": dataset.category_ids[label - 1], "score": score,
                 "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]]}
        if masks is not None:
            rle = mask_utils.encode(np.asfortranarray(masks[k]))
            rle["counts"] = rle["counts"].decode("ascii")
            entry["segmentation"] = rle
        detections.append(entry)
    return detections


def coco_average_precision(annotation_file: Path, detections: list[dict[str, Any]], iou_type: str) -> dict[str, float]:
    """``{"ap": AP@[.5:.95], "ap50": AP@.5}`` from pycocotools (0 when there is no detection at all)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    # loadRes reads "bbox" before "segmentation" and overwrites masks with box polygons: give it one kind
    dropped = "segmentation" if iou_type == "bbox" else "bbox"
    detections = [{k: v for k, v in entry.items() if k != dropped} for entry in detections]
    if not detections:
        return {"ap": 0.0, "ap50": 0.0}
    report = io.StringIO()
    with _STDOUT, contextlib.redirect_stdout(report):  # pycocotools prints its progress and summary
        ground_truth = COCO(str(annotation_file))
        evaluation = COCOeval(ground_truth, ground_truth.loadRes(detections), iouType=iou_type)
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    logger.debug("pycocotools %s:\n%s", iou_type, report.getvalue())
    ap, ap50 = (max(0.0, float(value)) for value in evaluation.stats[:2])  # -1 means "no ground truth"
    return {"ap": ap, "ap50": ap50}


def open_coco(root: str | Path) -> dict[str, Any]:
    """Paths and parsed annotations of both splits; whether masks are available (in both)."""
    splits = {}
    for split in ("train", "val"):
        annotation_file, image_dir = coco_paths(root, split)
        splits[split] = {"annotations": annotation_file, "images": image_dir, "data": read_coco_json(annotation_file)}
    train_categories = sorted(c["id"] for c in splits["train"]["data"]["categories"])
    if sorted(c["id"] for c in splits["val"]["data"]["categories"]) != train_categories:
        raise ValueError(f"COCO annotation files under {root} disagree on the categories")
    splits["with_masks"] = all(coco_has_masks(splits[s]["data"]) for s in ("train", "val"))
    return splits


def detection_eval(encoder: nn.Module, root: str | Path, settings: DetectionSettings, loading: Loading,
                   checkpoint: EpochCheckpoint | None = None) -> dict[str, float]:
    """Trains a detector on ``root``'s train split and returns AP on its val split (rank 0; ``{}`` elsewhere)."""
    splits = open_coco(root)
    with_masks = splits["with_masks"]
    train = CocoDetectionDataset(splits["train"]["data"], splits["train"]["images"], settings.img_size, with_masks)
    val = CocoDetectionDataset(splits["val"]["data"], splits["val"]["images"], settings.img_size, with_masks)
    with seeded(job_seed(settings.seed, "heads")):
        detector = build_detector(encoder, len(train.category_ids), with_masks, settings)
    train_detector(detector, train, settings, loading, checkpoint)
    detections = predict_coco(detector, val, settings.batch_size, loading)
    if rank_and_world()[0] != 0:
        return {}
    box = coco_average_precision(splits["val"]["annotations"], detections, "bbox")
    metrics = {"ap_box": box["ap"], "ap50_box": box["ap50"]}
    if with_masks:
        mask = coco_average_precision(splits["val"]["annotations"], detections, "segm")
        metrics.update(ap_mask=mask["ap"], ap50_mask=mask["ap50"])
    metrics["detections"] = float(len(detections))
    return metrics
