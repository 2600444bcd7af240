"""The five evaluation jobs behind one interface: open the data once, then run on any encoder.

:func:`prepare_job` checks the data (a missing path or malformed file fails here, before any model is
built) and returns a function ``encoder -> metrics``; the caller runs it on the pre-trained encoder and
on a randomly initialised one of the same size, so both see the same data and settings.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image
from torch import nn

from vip_core.config import EVAL_TASKS, EvaluationConfig, FinetunePrivacyConfig, ModelConfig
from vip_core.eval.datasets import Uniform, ade20k_pairs, ade20k_root, open_classification, uniform_from
from vip_core.eval.detection import DetectionSettings, detection_eval, open_coco
from vip_core.eval.features import extract_features
from vip_core.eval.fewshot import few_shot
from vip_core.eval.finetune import EncoderClassifier, FinetuneSettings, evaluate_classifier, finetune
from vip_core.eval.linprobe import ProbeSettings, linear_probe
from vip_core.eval.mixing import set_drop_path
from vip_core.eval.seeding import job_seed, seeded
from vip_core.eval.segmentation import SegmentationSettings, segmentation_eval
from vip_core.privacy.randomness import RandomStream, private_entropy

logger = logging.getLogger(__name__)

Job = Callable[[nn.Module], dict[str, float]]


def prepare_job(task: str, data: str | Path, evaluation: EvaluationConfig, model: ModelConfig,
                device: torch.device, runs: Sequence[str] = ("result",), ledgers: str | Path | None = None) -> Job:
    """Opens ``data`` for ``task`` and returns the job as a function of the encoder.

    ``runs`` names the encoders the job will be called on, in order (``result``, then ``baseline``): DP
    fine-tuning charges each of them to the fine-tuning set's ledger, in the folder ``ledgers``, before any runs.

    Raises:
        FileNotFoundError: a path the task needs is missing (named in the message).
        ValueError: an unknown task, or malformed data (the file is named in the message).
    """
    builders = {"linprobe": _linprobe, "finetune": _finetune, "fewshot": _fewshot, "coco": _coco, "ade20k": _ade20k}
    if task not in builders:
        raise ValueError(f"unknown task {task!r} (known: {', '.join(EVAL_TASKS)})")
    if task == "finetune":
        return _finetune(Path(data), evaluation, model, device, runs, ledgers)
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
                             seed=job_seed(evaluation.seed, "linprobe"))

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


def _finetune(data: Path, evaluation: EvaluationConfig, model: ModelConfig, device: torch.device,
              runs: Sequence[str], ledgers: str | Path | None) -> Job:
    dataset = open_classification(data)
    val = dataset.split("val", model.img_size)
    settings = FinetuneSettings(epochs=evaluation.finetune_epochs, lr=evaluation.finetune_lr,
                                batch_size=evaluation.batch_size, layer_decay=evaluation.layer_decay,
                                weight_decay=evaluation.finetune_weight_decay,
                                seed=job_seed(evaluation.seed, "finetune"), precision=evaluation.precision,
                                drop_path=evaluation.finetune_drop_path,
                                label_smoothing=evaluation.finetune_label_smoothing,
                                mixup=evaluation.finetune_mixup, cutmix=evaluation.finetune_cutmix)
    private = evaluation.finetune_privacy
    if not private.enabled:
        crops, drops = torch.Generator(), torch.Generator()
        train = dataset.split("train", model.img_size, augment=uniform_from(crops),
                              randaugment=evaluation.finetune_randaugment)

        def job(encoder: nn.Module) -> dict[str, float]:
            crops.manual_seed(job_seed(settings.seed, "crops"))  # both encoders see the same crops and flips
            drops.manual_seed(job_seed(settings.seed, "drop path"))  # and the same dropped paths
            classifier = _classifier(encoder, dataset.num_classes, settings, uniform_from(drops))
            classifier = finetune(classifier, train, settings, device)
            return {**evaluate_classifier(classifier, val, evaluation.batch_size, device),
                    "chance_top1": 1 / dataset.num_classes}

        return job
    if ledgers is None:
        raise ValueError("evaluation.finetune_privacy.enabled: DP fine-tuning needs the folder of the privacy "
                         "ledgers, to charge the fine-tuning set")
    if settings.mixes:
        logger.warning("evaluation.finetune_mixup and finetune_cutmix are left off in DP fine-tuning: they mix "
                       "samples, which per-sample clipping does not bound")
    train = dataset.split("train", model.img_size, augment=dp_augmentation_stream(private).uniform,
                          randaugment=evaluation.finetune_randaugment)
    return _dp_finetune_job(train, val, dataset.num_classes, settings, evaluation, device, runs, Path(ledgers))


def _classifier(encoder: nn.Module, num_classes: int, settings: FinetuneSettings, drops: Uniform) -> EncoderClassifier:
    """The fine-tuning classifier around ``encoder``, its head initialised from the job's seed, its blocks with
    ``settings.drop_path`` drawing from ``drops``."""
    with seeded(job_seed(settings.seed, "head")):
        classifier = EncoderClassifier(encoder, num_classes)
    set_drop_path(classifier.encoder, settings.drop_path, drops)
    return classifier


def dp_augmentation_stream(private: FinetunePrivacyConfig) -> RandomStream:
    """DP fine-tuning's crops, flips and dropped paths: fresh 128-bit OS entropy like its sampling and noise, and
    the OS CSPRNG itself in secure mode (RandAugment runs under torch's generator, seeded per image from it)."""
    return RandomStream(private_entropy(), 0, "sample", "secure" if private.secure_mode else "default")


def _dp_finetune_job(train, val, num_classes: int, settings: FinetuneSettings, evaluation: EvaluationConfig,
                     device: torch.device, runs: Sequence[str], ledgers: Path) -> Job:
    """DP fine-tuning of each encoder in turn, every run charged to the set's ledger before the first starts.

    ``dp_epsilon`` is the set's ε once every planned run is taken (the ε to report for any of them);
    ``dp_epsilon_after_this_run`` is the ledger's value when this run ended.
    """
    from vip_core.eval.dp_finetune import dp_finetune, plan_dp_finetune

    job_id = uuid.uuid4().hex[:12]
    run_ids = [f"{job_id}-{role}" for role in runs]
    private = evaluation.finetune_privacy
    plan = plan_dp_finetune(private, train, run_ids, ledgers)  # settings that cannot hold fail now, before training
    taken: list[str] = []

    def job(encoder: nn.Module) -> dict[str, float]:
        if len(taken) == len(run_ids):
            raise RuntimeError(f"DP fine-tuning was planned for {len(run_ids)} runs ({', '.join(runs)}); no budget "
                               "is left for another")
        drops = dp_augmentation_stream(private).uniform
        classifier = _classifier(encoder, num_classes, settings, drops)
        epsilon = dp_finetune(classifier, train, settings, private, plan, device, run=run_ids[len(taken)],
                              ledgers=ledgers, earlier_runs=len(taken))
        taken.append(run_ids[len(taken)])
        return {**evaluate_classifier(classifier, val, evaluation.batch_size, device), "chance_top1": 1 / num_classes,
                "dp_epsilon": plan.epsilon, "dp_epsilon_after_this_run": epsilon, "dp_delta": plan.delta,
                "dp_noise_multiplier": plan.noise_multiplier,
                "dp_sample_rate": plan.sample_rate, "dp_steps": float(plan.steps),
                "dp_max_grad_norm": plan.max_grad_norm, "dp_runs_charged": float(len(run_ids)),
                "mixup_used": 0.0, "cutmix_used": 0.0}  # left off in DP fine-tuning whatever the config says

    job.privacy = {"fingerprint": plan.fingerprint, "runs": list(zip(runs, run_ids)),  # type: ignore[attr-defined]
                   "planned_epsilon": plan.epsilon, "earlier_runs": [c.run for c in plan.prior]}
    return job


def _coco(data: Path, evaluation: EvaluationConfig, model: ModelConfig, device: torch.device) -> Job:
    open_coco(data)
    settings = DetectionSettings(img_size=evaluation.detection_img_size, channels=evaluation.detection_channels,
                                 epochs=evaluation.detection_epochs, lr=evaluation.detection_lr,
                                 batch_size=evaluation.batch_size, layer_decay=evaluation.layer_decay,
                                 seed=job_seed(evaluation.seed, "coco"))
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
                                    seed=job_seed(evaluation.seed, "ade20k"))
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
