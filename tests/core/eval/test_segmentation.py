"""Segmentation metrics against known answers: mIoU and pixel accuracy, ignored pixels left out."""

from __future__ import annotations

import pytest
import torch

from vip_core.eval.datasets import IGNORE_LABEL
from vip_core.eval.segmentation import confusion_matrix, miou_from_confusion


def test_miou_of_a_known_confusion_and_ignored_pixels():
    predicted = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    truth = torch.tensor([0, 0, 0, 0, 1, 1, IGNORE_LABEL])
    confusion = confusion_matrix(predicted, truth, num_classes=3)
    scores = miou_from_confusion(confusion)
    # class 0: 3 / 4, class 1: 2 / 3, class 2 absent from truth and predictions: not scored
    assert scores["miou"] == pytest.approx((3 / 4 + 2 / 3) / 2)
    assert scores["pixel_accuracy"] == pytest.approx(5 / 6)
    assert scores["classes_scored"] == 2
