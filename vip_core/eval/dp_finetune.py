"""DP fine-tuning: the fine-tuning set is treated as private, and each encoder is fine-tuned by the one
private step (:class:`~vip_core.train.step.PrivateStep`).

The job fine-tunes two encoders on the same set, the checkpoint's and a random-init baseline. Both runs
are charged to the set's ledger (:func:`plan_dp_finetune`), and σ is calibrated so that they compose,
with any earlier run on the set, to at most ``target_epsilon``: the ε reported is that composed one. Each
run is a :class:`~vip_core.train.step.PrivateStep` with fine-tuning's layer-decayed AdamW groups and its
warmup-cosine schedule: Poisson sampling at q = B / N, per-sample clipping to C over every parameter,
Gaussian noise σC once per step, division by B, randomness from fresh 128-bit OS entropy. This guarantee
covers the fine-tuning data; pre-training data has its own.

Across ``W`` workers it runs the way private pre-training does (``tasks/stages/pretrain.py``): the plan is charged
once, before any worker starts; each worker owns a contiguous block of the set and Poisson-samples it at q with its
own stream, and the private step adds the noise on rank 0 only and sums the clipped gradients over the workers, so
the union of the blocks' samples is a Poisson sample of the whole set and the noise has std σC whatever ``W`` is.
Rank 0 settles the run's charge in the set's one ledger with the steps taken.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from vip_core.config import FinetunePrivacyConfig
from vip_core.eval.finetune import EncoderClassifier, FinetuneSettings
from vip_core.eval.fit import WARMUP_FRACTION, layer_decay_param_groups
from vip_core.privacy.ledger import LedgerBook
from vip_core.privacy.plan import PrivacyPlan, fingerprint_of, plan_and_charge, settle_charge
from vip_core.privacy.randomness import RandomStream
from vip_core.train.data import DAMAGED_IMAGE_ERRORS, normalise, partition_range
from vip_core.train.distributed import broadcast_parameters, rank_and_world
from vip_core.train.loop import run_steps
from vip_core.train.precision import autocast
from vip_core.train.schedule import Schedule
from vip_core.train.step import PrivateStep, StepReport

logger = logging.getLogger(__name__)

PURPOSE = "dp-finetune"
FIELD = "evaluation.finetune_privacy"


def dataset_fingerprint(dataset: Dataset) -> str:
    """The fingerprint of a file-backed data set: each file's path inside the split's folder (so that the same
    folder reached by another path, or a link, is the same set), size and label; else of its length."""
    samples = getattr(dataset, "samples", None)
    if samples is None:
        return fingerprint_of([(type(dataset).__name__, 0, len(dataset))])
    root = Path(dataset.split_dir)
    return fingerprint_of([(path.relative_to(root).as_posix(), path.stat().st_size, int(label))
                           for path, label in samples])


def plan_dp_finetune(private: FinetunePrivacyConfig, train: Dataset, runs: Sequence[str],
                     ledgers: str | Path) -> PrivacyPlan:
    """Plans the fine-tuning runs ``runs`` on ``train`` against the set's ledger and charges every one.

    Args:
        private: the DP fine-tuning settings.
        train: the fine-tuning set (private).
        runs: one id per run (the checkpoint's encoder, the baseline).
        ledgers: the folder of the privacy ledgers.

    Raises:
        ConfigError: the batch is larger than the set, or the budget cannot hold the runs (naming the field).
    """
    fingerprint = dataset_fingerprint(train)
    book = LedgerBook.for_data_set(fingerprint, ledgers)
    return plan_and_charge(
        book, runs=runs, purpose=PURPOSE, budget=private, dataset_size=len(train), batch_size=private.batch_size,
        steps=private.steps, fingerprint=fingerprint, field=FIELD, batch_field=f"{FIELD}.batch_size",
    )


def dp_finetune(model: EncoderClassifier, train: Dataset, settings: FinetuneSettings, private: FinetunePrivacyConfig,
                plan: PrivacyPlan, device: torch.device, *, run: str, ledgers: str | Path,
                earlier_runs: int = 0) -> float:
    """Fine-tunes ``model`` privately on ``train`` as run ``run`` of ``plan``; returns the set's ε after it.

    Args:
        model: the classifier (moved to ``device``).
        train: the fine-tuning set, whose items are ``(uint8 image [3, S, S], label)``.
        settings: the fine-tuning hyperparameters (base lr per 256, layer decay, weight decay, label smoothing;
            mixup and cutmix are not used: they mix samples).
        private: the DP fine-tuning settings (physical batch size).
        plan: the plan from :func:`plan_dp_finetune`.
        device: where to train.
        run: this run's id, one of the ids the plan was charged for.
        ledgers: the folder of the privacy ledgers (rank 0 settles the set's charge with the steps taken).
        earlier_runs: runs of this plan already taken (their steps count in ε).
    """
    model.to(device).train()
    broadcast_parameters(model)
    rank, world = rank_and_world()
    start, stop = partition_range(len(train), rank, world)  # this worker's block of the set
    lr = settings.lr * plan.batch_size / 256
    groups = layer_decay_param_groups(model, "encoder.", len(model.encoder.blocks), lr, settings.weight_decay,
                                      settings.layer_decay)
    schedule = Schedule(peak_lr=lr, total_steps=plan.steps, warmup_steps=max(1, int(plan.steps * WARMUP_FRACTION)))
    step = PrivateStep(model, plan, schedule, local_size=stop - start, physical_batch_size=private.physical_batch_size,
                       betas=(0.9, 0.999), weight_decay=settings.weight_decay, param_groups=groups,
                       earlier_runs=earlier_runs)

    side = tuple(model.encoder.patch_embed.img_size)

    def batch(local: torch.Tensor, stream: RandomStream) -> tuple[torch.Tensor, torch.Tensor]:
        # the sample's uint8 images and labels, as pre-training hands its images over: the engine's one-time layout
        # check watches them where the loss makes them floating point
        return _gather(train, local + start, side)  # images: [k, 3, S, S], labels: [k]

    def loss(classifier: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = inputs  # images: [b, 3, S, S], labels: [b]
        with autocast(settings.precision, device):
            logits = classifier(normalise(images.to(device)))  # [b, classes]
        return nn.functional.cross_entropy(logits.float(), labels.to(device), reduction="none",
                                           label_smoothing=settings.label_smoothing)  # [b]

    def progress(report: StepReport) -> None:
        if rank == 0 and report.step % max(1, plan.steps // 5) == 0:
            logger.info("DP fine-tune step %d/%d: epsilon %.3f", report.step, plan.steps, report.epsilon)

    run_steps(step, batch, loss, until=plan.steps, on_step=progress)
    if rank == 0:
        settle_charge(LedgerBook.for_data_set(plan.fingerprint, ledgers), plan, run, PURPOSE, step.counted)
    return step.epsilon


def _gather(dataset: Dataset, indices: torch.Tensor, side: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled images ``[k, 3, *side]`` uint8 and labels ``[k]``. A damaged image is left out, as pre-training
    leaves one out: it contributes nothing (a null sample), where a failed job would tell that it was sampled."""
    images, labels = [], []
    for index in indices.tolist():
        try:
            image, label = dataset[index]
        except DAMAGED_IMAGE_ERRORS:
            continue
        images.append(image)
        labels.append(label)
    if not images:  # an empty Poisson sample, or only damaged images
        return torch.zeros(0, 3, *side, dtype=torch.uint8), torch.zeros(0, dtype=torch.long)
    return torch.stack(images), torch.tensor(labels)
