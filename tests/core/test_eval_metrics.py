"""Evaluation metrics against known answers: top-k, mIoU, COCO AP of perfect and of wrong detections,
and the layer-wise learning-rate decay of the optimiser groups."""

from __future__ import annotations

import pytest
import torch
from pycocotools import mask as mask_utils

from tasks.demo_data import make_coco_shapes
from vip_core.config import tiny
from vip_core.eval.datasets import IGNORE_LABEL, CocoDetectionDataset
from vip_core.eval.detection import _to_coco, coco_average_precision, open_coco
from vip_core.eval.features import topk_accuracy
from vip_core.eval.finetune import EncoderClassifier
from vip_core.eval.optim import layer_decay_param_groups
from vip_core.eval.segmentation import confusion_matrix, miou_from_confusion
from vip_core.models import build_encoder


def test_topk_accuracy_counts_a_hit_anywhere_in_the_top_k():
    logits = torch.tensor([[0.9, 0.1, 0.0, 0.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    labels = torch.tensor([0, 0])
    assert topk_accuracy(logits, labels) == {"top1": 0.5, "top5": 0.5}
    assert topk_accuracy(logits, torch.tensor([1, 2]))["top5"] == 1.0


def test_miou_of_a_known_confusion_and_ignored_pixels():
    predicted = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    truth = torch.tensor([0, 0, 0, 0, 1, 1, IGNORE_LABEL])
    confusion = confusion_matrix(predicted, truth, num_classes=3)
    scores = miou_from_confusion(confusion)
    # class 0: 3 / 4, class 1: 2 / 3, class 2 absent from truth and predictions: not scored
    assert scores["miou"] == pytest.approx((3 / 4 + 2 / 3) / 2)
    assert scores["pixel_accuracy"] == pytest.approx(5 / 6)
    assert scores["classes_scored"] == 2


@pytest.fixture(scope="module")
def coco_val(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco")
    make_coco_shapes(root, img_size=40, n=16)
    splits = open_coco(root)
    dataset = CocoDetectionDataset(splits["val"]["data"], splits["val"]["images"], size=80, with_masks=True)
    return splits["val"]["annotations"], dataset


def _ground_truth_as_outputs(dataset: CocoDetectionDataset, label_shift: int = 0) -> list[dict]:
    detections = []
    for index, info in enumerate(dataset.images):
        _, target = dataset[index]
        labels = (target["labels"] - 1 + label_shift) % len(dataset.category_ids) + 1
        output = {"boxes": target["boxes"], "scores": torch.ones(len(labels)), "labels": labels,
                  "masks": target["masks"][:, None].float()}  # [K, 1, S, S]
        detections += _to_coco(output, info, dataset, mask_utils)
    return detections


def test_ground_truth_fed_back_as_detections_scores_full_ap(coco_val):
    annotations, dataset = coco_val
    detections = _ground_truth_as_outputs(dataset)
    box = coco_average_precision(annotations, detections, "bbox")
    mask = coco_average_precision(annotations, detections, "segm")
    assert box["ap"] > 0.95 and box["ap50"] == pytest.approx(1.0)
    assert mask["ap50"] == pytest.approx(1.0) and mask["ap"] > 0.6


def test_detections_with_the_wrong_category_score_no_ap(coco_val):
    annotations, dataset = coco_val
    detections = _ground_truth_as_outputs(dataset, label_shift=1)
    assert coco_average_precision(annotations, detections, "bbox")["ap"] == 0.0
    assert coco_average_precision(annotations, [], "bbox") == {"ap": 0.0, "ap50": 0.0}


def test_layer_decay_gives_the_head_full_lr_and_earlier_blocks_less():
    model = EncoderClassifier(build_encoder(tiny().model), num_classes=3)
    depth = len(model.encoder.blocks)
    groups = layer_decay_param_groups(model, "encoder.", depth, lr=1.0, weight_decay=0.05, layer_decay=0.5)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    decay_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert lr_of[id(model.head.weight)] == 1.0
    assert lr_of[id(model.encoder.blocks[-1].mlp.fc1.weight)] == 0.5
    assert lr_of[id(model.encoder.blocks[0].mlp.fc1.weight)] == 0.5 ** depth
    assert lr_of[id(model.encoder.patch_embed.proj.weight)] == 0.5 ** (depth + 1)
    assert decay_of[id(model.encoder.blocks[0].mlp.fc1.weight)] == 0.05
    assert decay_of[id(model.encoder.blocks[0].mlp.fc1.bias)] == 0.0
    assert decay_of[id(model.encoder.cls_token)] == 0.0
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert set(lr_of) == trainable, "every trainable parameter is in exactly one group"
