"""COCO AP by pycocotools on known answers: perfect detections score full AP, wrong categories none."""

from __future__ import annotations

import logging

import pytest
import torch
from pycocotools import mask as mask_utils

from tasks.fixtures.eval_sets import make_coco_shapes
from vip_core.eval.datasets import CocoDetectionDataset
from vip_core.eval.detection import _to_coco, coco_average_precision, open_coco


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


def test_pycocotools_reports_to_the_debug_log_not_to_stdout(coco_val, capfd, caplog):
    annotations, dataset = coco_val
    with caplog.at_level(logging.DEBUG, logger="vip_core.eval.detection"):
        box = coco_average_precision(annotations, _ground_truth_as_outputs(dataset), "bbox")
    assert box["ap50"] == pytest.approx(1.0)
    assert capfd.readouterr().out == ""
    assert "Average Precision" in caplog.text and "DONE" in caplog.text


def test_detections_with_the_wrong_category_score_no_ap(coco_val):
    annotations, dataset = coco_val
    detections = _ground_truth_as_outputs(dataset, label_shift=1)
    assert coco_average_precision(annotations, detections, "bbox")["ap"] == 0.0
    assert coco_average_precision(annotations, [], "bbox") == {"ap": 0.0, "ap50": 0.0}
