"""End-to-end fine-tuning with layer-wise learning-rate decay (the DP variant is :mod:`vip_core.eval.dp_finetune`).

The classifier is the encoder, its patch tokens mean-pooled, a LayerNorm and a linear head (MAE's
fine-tuning model). AdamW trains every trainable parameter; block ``i`` of a depth-``L`` encoder learns
at ``lr * decay ** (L + 1 - (i + 1))``, the embeddings at ``lr * decay ** (L + 1)``, the head at ``lr``.
Label smoothing, mixup and cutmix, and drop path follow MAE's fine-tuning recipe (:mod:`vip_core.eval.mixing`).
Drop path and mixup draw from generators keyed by the job's seed, the epoch and the worker, so a run resumed after
its last finished epoch (:class:`~vip_core.eval.fit.EpochCheckpoint`) goes on as the uninterrupted run would.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

from vip_core.eval.datasets import uniform_from
from vip_core.eval.features import TopK
from vip_core.eval.fit import EpochCheckpoint, FitSettings, fit, layer_decay_adamw, warmup_cosine_schedule
from vip_core.eval.loading import EpochBatches, Loading, rank_block
from vip_core.eval.mixing import mix_batch, set_drop_path, soft_cross_entropy, soft_targets
from vip_core.eval.seeding import job_seed, numpy_generator
from vip_core.train.distributed import rank_and_world
from vip_core.train.precision import autocast

logger = logging.getLogger(__name__)


class EncoderClassifier(nn.Module):
    """Encoder, mean-pooled patch tokens, LayerNorm, linear head."""

    def __init__(self, encoder: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.fc_norm = nn.LayerNorm(encoder.embed_dim, eps=1e-6)
        self.head = nn.Linear(encoder.embed_dim, num_classes)
        nn.init.trunc_normal_(self.head.weight, std=2e-5)
        nn.init.zeros_(self.head.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.encoder.forward_features(images)  # [N, P + L, D]
        pooled = tokens[:, self.encoder.num_prefix_tokens:].mean(dim=1)  # [N, D]
        return self.head(self.fc_norm(pooled))  # [N, C]


@dataclass(frozen=True, kw_only=True)
class FinetuneSettings(FitSettings):
    """Fine-tuning hyperparameters. ``lr`` is the base rate per 256 examples of the (expected) batch;
    ``drop_path`` the last block's stochastic depth, ``label_smoothing`` the targets' smoothing, ``mixup`` and
    ``cutmix`` the α of their Beta draws (0: off; public fine-tuning only), as in :mod:`vip_core.eval.mixing`."""

    drop_path: float = 0.0
    label_smoothing: float = 0.0
    mixup: float = 0.0
    cutmix: float = 0.0

    @property
    def mixes(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0


def build_optimizer(model: EncoderClassifier, settings: FinetuneSettings, batch_size: int,
                    total_steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The fine-tuning optimiser (:func:`fine_tuning_adamw`) and its warmup-cosine schedule over ``total_steps``."""
    optimizer = fine_tuning_adamw(model, settings, batch_size)
    return optimizer, warmup_cosine_schedule(optimizer, total_steps)


def fine_tuning_adamw(model: EncoderClassifier, settings: FinetuneSettings, batch_size: int) -> torch.optim.AdamW:
    """AdamW with layer-decayed groups at ``settings.lr`` per 256 examples of a ``batch_size`` batch."""
    return layer_decay_adamw(model, "encoder.", lr=settings.lr * batch_size / 256,
                             weight_decay=settings.weight_decay, layer_decay=settings.layer_decay)


def finetune(model: EncoderClassifier, train: Dataset, settings: FinetuneSettings, loading: Loading,
             checkpoint: EpochCheckpoint | None = None) -> EncoderClassifier:
    """Non-private end-to-end fine-tuning for ``settings.epochs`` epochs, this worker on its share of each batch."""
    sampler = EpochBatches(len(train), settings.batch_size, seed=settings.seed, name="fine-tune order",
                           drop_last=len(train) > settings.batch_size)
    epochs = loading.epochs(train, sampler)
    drops = torch.Generator()
    set_drop_path(model.encoder, settings.drop_path, uniform_from(drops))
    optimizer = fine_tuning_adamw(model, settings, settings.batch_size)
    model.to(loading.device)
    rank, _ = rank_and_world()
    mixing = numpy_generator(settings.seed, "mixup")

    def epoch_start(epoch: int) -> None:
        nonlocal mixing
        drops.manual_seed(job_seed(settings.seed, "drop path", str(epoch), str(rank)))
        mixing = numpy_generator(settings.seed, "mixup", str(epoch), str(rank))

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = loading.images(batch[0]), loading.to_device(batch[1])  # [n, 3, S, S], [n]
        if not settings.mixes:
            with autocast(settings.precision, loading.device):
                logits = model(images)  # [n, classes]
            return nn.functional.cross_entropy(logits.float(), labels, label_smoothing=settings.label_smoothing)
        targets = soft_targets(labels, model.head.out_features, settings.label_smoothing)  # [n, classes]
        images, targets = mix_batch(images, targets, mixup=settings.mixup, cutmix=settings.cutmix, rng=mixing)
        with autocast(settings.precision, loading.device):
            logits = model(images)  # [n, classes]
        return soft_cross_entropy(logits.float(), targets).mean()

    fit(model, optimizer, epochs, loss_of, epochs=settings.epochs, steps_per_epoch=len(sampler), name="fine-tune", checkpoint=checkpoint,
        epoch_start=epoch_start)
    return model


@torch.no_grad()
def evaluate_classifier(model: nn.Module, dataset: Dataset, batch_size: int, loading: Loading,
                        precision: str = "fp32") -> dict[str, float]:
    """Top-1 and top-5 accuracy on ``dataset``: this worker's block, summed over the workers."""
    model.to(loading.device).eval()
    scores = TopK()
    for images, targets in loading.in_order(rank_block(dataset), batch_size):
        with autocast(precision, loading.device):
            logits = model(loading.images(images))  # [b, classes]
        scores.add(logits.float(), torch.as_tensor(targets))
    return scores.accuracy()
