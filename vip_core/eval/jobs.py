"""The five evaluation jobs behind one interface: open the data once, then run on any encoder.

:func:`prepare_job` checks the data (a missing path or malformed file fails here, before any model is
built) and returns a function ``encoder -> metrics``; the caller runs it on the pre-trained encoder and
on a randomly initialised one of the same size, so both see the same data and settings.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image
from torch import nn

from vip_core.config import EVAL_TASKS, EvaluationConfig, ModelConfig
from vip_core.eval.datasets import ade20k_pairs, ade20k_root, open_classification
from vip_core.eval.detection import DetectionSettings, detection_eval, open_coco
from vip_core.eval.features import extract_features
from vip_core.eval.fewshot import few_shot
from vip_core.eval.finetune import (
    DPSettings, EncoderClassifier, FinetuneSettings, dp_finetune, evaluate_classifier, finetune, plan_dp,
)
from vip_core.eval.linprobe import ProbeSettings, linear_probe
from vip_core.eval.segmentation import SegmentationSettings, segmentation_eval

logger = logging.getLogger(__name__)

Job = Callable[[nn.Module], dict[str, float]]


def prepare_job(task: str, data: str | Path, evaluation: EvaluationConfig, model: ModelConfig,
                device: torch.device) -> Job:
    """Opens ``data`` for ``task`` and returns the job as a function of the encoder.

    Raises:
        FileNotFoundError: a path the task needs is missing (named in the message).
        ValueError: an unknown task, or malformed data (the file is named in the message).
    """
    builders = {"linprobe": _linprobe, "finetune": _finetune, "fewshot": _fewshot, "coco": _coco, "ade20k": _ade20k}
    if task not in builders:
        raise ValueError(f"unknown task {task!r} (known: {', '.join(EVAL_TASKS)})")
    return builders[task](Path(data), evaluation, model, device)


def _features_of(data, evaluation: EvaluationConfig, model: ModelConfig, device: torch.device) -> Callable:
    train, val = data.split("train", model.img_size), data.split("val", model.img_size)

    def features(encoder: nn.Module) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        options = dict(last_blocks=evaluation.linprobe_last_blocks, batch_size=evaluation.batch_size, device=device)
        return extract_features(encoder, train, **options), extract_features(encoder, val, **options)

    return features


def _linprobe(data: Path, evaluation: EvaluationConfig, model: ModelConfig, device: torch.device) -> Job:
    dataset = open_classification(data)
    features = _features_of(dataset, evaluation, model, device)
    settings = ProbeSettings(epochs=evaluation.linprobe_epochs, lr=evaluation.linprobe_lr,
                             batch_size=evaluation.batch_size, optimizer=evaluation.linprobe_optimizer,
                             seed=evaluation.seed)

    def job(encoder: nn.Module) -> dict[str, float]:
        train, val = features(encoder)
        return {**linear_probe(train, val, dataset.num_classes, settings), "chance_top1": 1 / dataset.num_classes}

    return job


def _fewshot(data: Path, evaluation: EvaluationConfig, model: ModelConfig, device: torch.device) -> Job:
    dataset = open_classification(data)
    features = _features_of(dataset, evaluation, model, device)

    def job(encoder: nn.Module) -> dict[str, float]:
        train, val = features(encoder)
        result = few_shot(train, val, dataset.num_classes, shots=evaluation.fewshot_shots,
                          seeds=evaluation.fewshot_seeds, l2=evaluation.fewshot_l2, seed=evaluation.seed)
        return {**result, "chance_top1": 1 / dataset.num_classes}

    return job


def _finetune(data: Path, evaluation: EvaluationConfig, model: ModelConfig, device: torch.device) -> Job:
    dataset = open_classification(data)
    train = dataset.split("train", model.img_size, augment=True)
    val = dataset.split("val", model.img_size)
    settings = FinetuneSettings(epochs=evaluation.finetune_epochs, lr=evaluation.finetune_lr,
                                batch_size=evaluation.batch_size, layer_decay=evaluation.layer_decay,
                                weight_decay=evaluation.finetune_weight_decay, seed=evaluation.seed)
    private = evaluation.finetune_privacy
    dp, plan = None, {}
    if private.enabled:
        dp = DPSettings(target_epsilon=private.target_epsilon, delta=private.delta,
                        max_grad_norm=private.max_grad_norm, noise_multiplier=private.noise_multiplier,
                        batch_size=private.batch_size, physical_batch_size=private.physical_batch_size,
                        steps=private.steps, accountant=private.accountant)
        plan = plan_dp(dp, len(train))  # settings that cannot hold fail now, before any training
    report = {f"dp_{key}": float(value) for key, value in plan.items()}

    def job(encoder: nn.Module) -> dict[str, float]:
        classifier = EncoderClassifier(encoder, dataset.num_classes)
        if dp is None:
            finetune(classifier, train, settings, device)
        else:
            dp_finetune(classifier, train, settings, dp, plan, device)
        accuracy = evaluate_classifier(classifier, val, evaluation.batch_size, device)
        return {**accuracy, **report, "chance_top1": 1 / dataset.num_classes}

    return job


def _coco(data: Path, evaluation: EvaluationConfig, model: ModelConfig, device: torch.device) -> Job:
    open_coco(data)
    settings = DetectionSettings(img_size=evaluation.detection_img_size, channels=evaluation.detection_channels,
                                 epochs=evaluation.detection_epochs, lr=evaluation.detection_lr,
                                 batch_size=evaluation.batch_size, layer_decay=evaluation.layer_decay,
                                 seed=evaluation.seed)
    _check_multiple(settings.img_size, model.patch_size, "evaluation.detection_img_size")
    return lambda encoder: detection_eval(encoder, data, settings, device)


def _ade20k(data: Path, evaluation: EvaluationConfig, model: ModelConfig, device: torch.device) -> Job:
    root = ade20k_root(data)
    train_pairs = ade20k_pairs(root, "train")
    ade20k_pairs(root, "val")
    num_classes = evaluation.segmentation_num_classes or largest_label(label for _, label in train_pairs)
    settings = SegmentationSettings(img_size=evaluation.segmentation_img_size,
                                    channels=evaluation.segmentation_channels, num_classes=num_classes,
                                    epochs=evaluation.segmentation_epochs, lr=evaluation.segmentation_lr,
                                    batch_size=evaluation.batch_size, layer_decay=evaluation.layer_decay,
                                    seed=evaluation.seed)
    _check_multiple(settings.img_size, model.patch_size, "evaluation.segmentation_img_size")

    def job(encoder: nn.Module) -> dict[str, float]:
        return {**segmentation_eval(encoder, root, settings, device), "num_classes": float(num_classes)}

    return job


def largest_label(label_files) -> int:
    """The largest label value in the label pngs: the number of classes when labels run 1..K."""
    largest = 0
    for path in label_files:
        with Image.open(path) as picture:
            largest = max(largest, int(np.asarray(picture).max(initial=0)))
    if largest == 0:
        raise ValueError("ADE20K training annotations hold no labelled pixel (all 0)")
    return largest


def _check_multiple(img_size: int, patch_size: int, field: str) -> None:
    if img_size % (2 * patch_size):
        raise ValueError(f"{field}: {img_size} is not a multiple of 2 x patch_size ({2 * patch_size}), "
                         "which the pyramid's pooled level needs")
