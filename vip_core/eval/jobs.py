"""The five evaluation jobs behind one interface: open the data once, then run on any encoder.

:func:`prepare_job` checks the data (a missing path or malformed file fails here, before any model is
built) and returns a function ``job(encoder, run=None, workspace=None) -> metrics``; the caller runs it on the
pre-trained encoder and, when the config asks for it, on a randomly initialised one of the same size, so both
see the same data and settings. ``run`` is the encoder's place in the job's ``runs`` (by default the next one;
DP fine-tuning charges each run once); ``workspace`` a folder of
the encoder's own where the job keeps what it writes on the way (the linear probe's features, each epoch's
training state, from which a job started again resumes); without one the job uses a temporary folder.

The same job runs in one process or as one of several data-parallel workers (a Ray Train job): the data is dealt
out by :mod:`vip_core.eval.loading`, the scores summed over the workers, and DP fine-tuning's runs are charged once,
before any worker starts (:class:`DpRuns`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import Subset

from vip_core.config import EVAL_TASKS, EvaluationConfig, FinetunePrivacyConfig, ModelConfig
from vip_core.eval.datasets import ade20k_pairs, ade20k_root, keyed_draws, open_classification, stream_draws
from vip_core.eval.detection import DetectionSettings, detection_eval, open_coco
from vip_core.eval.feature_store import write_features
from vip_core.eval.features import extract_features, feature_batches
from vip_core.eval.fewshot import few_shot
from vip_core.eval.finetune import EncoderClassifier, FinetuneSettings, evaluate_classifier, finetune
from vip_core.eval.fit import EpochCheckpoint
from vip_core.eval.linprobe import ProbeSettings, linear_probe
from vip_core.eval.loading import Loading
from vip_core.eval.mixing import set_drop_path
from vip_core.eval.seeding import job_seed, seeded
from vip_core.eval.segmentation import SegmentationSettings, segmentation_eval
from vip_core.privacy.plan import PrivacyPlan
from vip_core.privacy.randomness import RandomStream, private_entropy

logger = logging.getLogger(__name__)

Job = Callable[..., dict[str, float]]
TRAINING_STATE = "training.pt"


@dataclasses.dataclass(frozen=True)
class DpRuns:
    """DP fine-tuning's runs on its set, charged to the set's ledger before the first starts: the plan, one run id
    per encoder (in the order of the job's ``runs``), and the folder of the ledgers."""

    plan: PrivacyPlan
    run_ids: tuple[str, ...]
    ledgers: str

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "run_ids": list(self.run_ids), "ledgers": self.ledgers}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DpRuns":
        return cls(PrivacyPlan.from_dict(data["plan"]), tuple(data["run_ids"]), data["ledgers"])


def prepare_job(task: str, data: str | Path, evaluation: EvaluationConfig, model: ModelConfig,
                device: torch.device, runs: Sequence[str] = ("result",), ledgers: str | Path | None = None,
                dp_runs: DpRuns | None = None) -> Job:
    """Opens ``data`` for ``task`` and returns the job as a function of the encoder.

    ``runs`` names the encoders the job will be called on, in order (``result``, then ``baseline``): DP
    fine-tuning charges each of them to the fine-tuning set's ledger, in the folder ``ledgers``, before any runs,
    unless ``dp_runs`` brings the runs already charged (a worker of a job planned by its driver).

    Raises:
        FileNotFoundError: a path the task needs is missing (named in the message).
        ValueError: an unknown task, malformed data or a bad setting (one line naming it).
    """
    builders = {"linprobe": _linprobe, "finetune": _finetune, "fewshot": _fewshot, "coco": _coco, "ade20k": _ade20k}
    if task not in builders:
        raise ValueError(f"unknown task {task!r} (known: {', '.join(EVAL_TASKS)})")
    loading = Loading(device, evaluation.loader_workers)
    if task == "finetune":
        return _finetune(Path(data), evaluation, model, loading, runs, ledgers, dp_runs)
    return builders[task](Path(data), evaluation, model, loading)


@contextlib.contextmanager
def _folder(workspace: str | Path | None) -> Iterator[Path]:
    """``workspace``, or a temporary folder for the block."""
    if workspace is not None:
        yield Path(workspace)
        return
    with tempfile.TemporaryDirectory(prefix="vip-eval-") as folder:
        yield Path(folder)


def _checkpoint(workspace: str | Path | None) -> EpochCheckpoint:
    """Where a job keeps its training state after each epoch (nowhere without a workspace)."""
    return EpochCheckpoint(None if workspace is None else Path(workspace) / TRAINING_STATE)


def _linprobe(data: Path, evaluation: EvaluationConfig, model: ModelConfig, loading: Loading) -> Job:
    dataset = open_classification(data)
    train, val = dataset.split("train", model.img_size), dataset.split("val", model.img_size)
    settings = ProbeSettings(epochs=evaluation.linprobe_epochs, lr=evaluation.linprobe_lr,
                             batch_size=evaluation.linprobe_batch_size or evaluation.batch_size,
                             optimizer=evaluation.linprobe_optimizer, seed=job_seed(evaluation.seed, "linprobe"))
    extraction = dict(last_blocks=evaluation.linprobe_last_blocks, batch_size=evaluation.batch_size, loading=loading,
                      precision=evaluation.precision)

    def job(encoder: nn.Module, run: int | None = None, workspace: str | Path | None = None) -> dict[str, float]:
        with _folder(workspace) as folder:
            stored = [write_features(encoder, split, folder / "features", name, **extraction)
                      for name, split in (("train", train), ("val", val))]
            metrics = linear_probe(*stored, dataset.num_classes, settings, loading.device, _checkpoint(workspace))
            for features in stored:
                features.close()
        return {**metrics, "chance_top1": 1 / dataset.num_classes}

    return job


def _fewshot(data: Path, evaluation: EvaluationConfig, model: ModelConfig, loading: Loading) -> Job:
    dataset = open_classification(data)
    train, val = dataset.split("train", model.img_size), dataset.split("val", model.img_size)
    extraction = dict(last_blocks=evaluation.linprobe_last_blocks, batch_size=evaluation.batch_size, loading=loading,
                      precision=evaluation.precision)

    def job(encoder: nn.Module, run: int | None = None, workspace: str | Path | None = None) -> dict[str, float]:
        def features_of(indices: torch.Tensor) -> torch.Tensor:
            return extract_features(encoder, Subset(train, indices.tolist()), **extraction)[0]  # [M, F]

        result = few_shot(train.labels, features_of, feature_batches(encoder, val, **extraction), dataset.num_classes,
                          shots=evaluation.fewshot_shots, seeds=evaluation.fewshot_seeds, l2=evaluation.fewshot_l2,
                          seed=evaluation.seed)
        return {**result, "chance_top1": 1 / dataset.num_classes}

    return job


def _finetune(data: Path, evaluation: EvaluationConfig, model: ModelConfig, loading: Loading,
              runs: Sequence[str], ledgers: str | Path | None, dp_runs: DpRuns | None) -> Job:
    dataset = open_classification(data)
    val = dataset.split("val", model.img_size)
    settings = FinetuneSettings(epochs=evaluation.finetune_epochs, lr=evaluation.finetune_lr,
                                batch_size=evaluation.finetune_batch_size or evaluation.batch_size,
                                layer_decay=evaluation.layer_decay, weight_decay=evaluation.finetune_weight_decay,
                                seed=job_seed(evaluation.seed, "finetune"), precision=evaluation.precision,
                                drop_path=evaluation.finetune_drop_path,
                                label_smoothing=evaluation.finetune_label_smoothing,
                                mixup=evaluation.finetune_mixup, cutmix=evaluation.finetune_cutmix)
    private = evaluation.finetune_privacy
    if not private.enabled:
        train = dataset.split("train", model.img_size, draws=keyed_draws(settings.seed, "crops"),
                              randaugment=evaluation.finetune_randaugment)

        def job(encoder: nn.Module, run: int | None = None, workspace: str | Path | None = None) -> dict[str, float]:
            classifier = finetune(_classifier(encoder, dataset.num_classes, settings), train, settings, loading,
                                  _checkpoint(workspace))
            return {**evaluate_classifier(classifier, val, evaluation.batch_size, loading, settings.precision),
                    "chance_top1": 1 / dataset.num_classes}

        return job
    if settings.mixes:
        logger.warning("evaluation.finetune_mixup and finetune_cutmix are left off in DP fine-tuning: they mix "
                       "samples, which per-sample clipping does not bound")
    stream = dp_augmentation_stream(private)
    train = dataset.split("train", model.img_size, draws=stream_draws(stream.uniform),
                          randaugment=evaluation.finetune_randaugment)
    if dp_runs is None:
        dp_runs = plan_dp_runs(private, train, runs, ledgers)  # settings that cannot hold fail now, before training
    return _dp_finetune_job(train, val, dataset.num_classes, settings, evaluation, loading, runs, dp_runs)


def _classifier(encoder: nn.Module, num_classes: int, settings: FinetuneSettings) -> EncoderClassifier:
    """The fine-tuning classifier around ``encoder``, its head initialised from the job's seed."""
    with seeded(job_seed(settings.seed, "head")):
        return EncoderClassifier(encoder, num_classes)


def dp_augmentation_stream(private: FinetunePrivacyConfig) -> RandomStream:
    """DP fine-tuning's crops, flips and dropped paths: fresh 128-bit OS entropy like its sampling and noise, and
    the OS CSPRNG itself in secure mode (RandAugment runs under torch's generator, seeded per image from it)."""
    return RandomStream(private_entropy(), 0, "sample", "secure" if private.secure_mode else "default")


def plan_dp_runs(private: FinetunePrivacyConfig, train, runs: Sequence[str], ledgers: str | Path | None) -> DpRuns:
    """Plans DP fine-tuning's ``runs`` on ``train`` and charges every one to the set's ledger in ``ledgers``."""
    from vip_core.eval.dp_finetune import plan_dp_finetune

    if ledgers is None:
        raise ValueError("evaluation.finetune_privacy.enabled: DP fine-tuning needs the folder of the privacy "
                         "ledgers, to charge the fine-tuning set")
    job_id = uuid.uuid4().hex[:12]
    run_ids = tuple(f"{job_id}-{role}" for role in runs)
    return DpRuns(plan_dp_finetune(private, train, run_ids, ledgers), run_ids, str(ledgers))


def _dp_finetune_job(train, val, num_classes: int, settings: FinetuneSettings, evaluation: EvaluationConfig,
                     loading: Loading, runs: Sequence[str], dp_runs: DpRuns) -> Job:
    """DP fine-tuning of each encoder in turn, every run charged to the set's ledger before the first starts.

    ``dp_epsilon`` is the set's ε once every planned run is taken (the ε to report for any of them);
    ``dp_epsilon_after_this_run`` is the ledger's value when this run ended.
    """
    from vip_core.eval.dp_finetune import dp_finetune

    private, plan = evaluation.finetune_privacy, dp_runs.plan
    taken: list[int] = []

    def job(encoder: nn.Module, run: int | None = None, workspace: str | Path | None = None) -> dict[str, float]:
        run = len(taken) if run is None else run  # by default, the next run of the plan
        if not 0 <= run < len(dp_runs.run_ids) or run in taken:
            raise RuntimeError(f"DP fine-tuning was planned for {len(dp_runs.run_ids)} runs ({', '.join(runs)}); "
                               "no budget is left for another")
        taken.append(run)
        classifier = _classifier(encoder, num_classes, settings)
        set_drop_path(classifier.encoder, settings.drop_path, dp_augmentation_stream(private).uniform)
        epsilon = dp_finetune(classifier, train, settings, private, plan, loading.device, run=dp_runs.run_ids[run],
                              ledgers=dp_runs.ledgers, earlier_runs=run)
        return {**evaluate_classifier(classifier, val, evaluation.batch_size, loading, settings.precision),
                "chance_top1": 1 / num_classes,
                "dp_epsilon": plan.epsilon, "dp_epsilon_after_this_run": epsilon, "dp_delta": plan.delta,
                "dp_noise_multiplier": plan.noise_multiplier,
                "dp_sample_rate": plan.sample_rate, "dp_steps": float(plan.steps),
                "dp_max_grad_norm": plan.max_grad_norm, "dp_runs_charged": float(len(dp_runs.run_ids)),
                "mixup_used": 0.0, "cutmix_used": 0.0}  # left off in DP fine-tuning whatever the config says

    job.privacy = {"fingerprint": plan.fingerprint, "runs": list(zip(runs, dp_runs.run_ids)),  # type: ignore[attr-defined]
                   "planned_epsilon": plan.epsilon, "earlier_runs": [c.run for c in plan.prior]}
    job.dp_runs = dp_runs  # type: ignore[attr-defined]
    return job


def _coco(data: Path, evaluation: EvaluationConfig, model: ModelConfig, loading: Loading) -> Job:
    open_coco(data)
    settings = DetectionSettings(img_size=evaluation.detection_img_size, channels=evaluation.detection_channels,
                                 epochs=evaluation.detection_epochs, lr=evaluation.detection_lr,
                                 batch_size=evaluation.batch_size, layer_decay=evaluation.layer_decay,
                                 seed=job_seed(evaluation.seed, "coco"))
    _check_multiple(settings.img_size, model.patch_size, "evaluation.detection_img_size")

    def job(encoder: nn.Module, run: int | None = None, workspace: str | Path | None = None) -> dict[str, float]:
        return detection_eval(encoder, data, settings, loading, _checkpoint(workspace))

    return job


def _ade20k(data: Path, evaluation: EvaluationConfig, model: ModelConfig, loading: Loading) -> Job:
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

    def job(encoder: nn.Module, run: int | None = None, workspace: str | Path | None = None) -> dict[str, float]:
        metrics = segmentation_eval(encoder, root, settings, loading, _checkpoint(workspace))
        return {**metrics, "num_classes": float(num_classes)}

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
