"""End-to-end fine-tuning with layer-wise learning-rate decay (the DP variant is :mod:`vip_core.eval.dp_finetune`).

The classifier is the encoder, its patch tokens mean-pooled, a LayerNorm and a linear head (MAE's
fine-tuning model). AdamW trains every trainable parameter; block ``i`` of a depth-``L`` encoder learns
at ``lr * decay ** (L + 1 - (i + 1))``, the embeddings at ``lr * decay ** (L + 1)``, the head at ``lr``.
Label smoothing, mixup and cutmix, and drop path follow MAE's fine-tuning recipe (:mod:`vip_core.eval.mixing`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

from vip_core.eval.features import topk_accuracy
from vip_core.eval.fit import FitSettings, fit, layer_decay_adamw, warmup_cosine_schedule
from vip_core.eval.mixing import mix_batch, soft_cross_entropy, soft_targets
from vip_core.eval.seeding import data_loader, generator, numpy_generator
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

    num_workers: int = 0
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


def finetune(model: EncoderClassifier, train: Dataset, settings: FinetuneSettings, device: torch.device) -> EncoderClassifier:
    """Non-private end-to-end fine-tuning for ``settings.epochs`` epochs."""
    loader = data_loader(train, batch_size=settings.batch_size, generator=generator(settings.seed, "shuffle"),
                         shuffle=True, drop_last=len(train) > settings.batch_size, num_workers=settings.num_workers)
    optimizer = fine_tuning_adamw(model, settings, settings.batch_size)
    model.to(device)
    mixing = numpy_generator(settings.seed, "mixup")

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch[0].to(device), batch[1].to(device)  # [N, 3, S, S], [N]
        if not settings.mixes:
            with autocast(settings.precision, device):
                logits = model(images)  # [N, classes]
            return nn.functional.cross_entropy(logits.float(), labels, label_smoothing=settings.label_smoothing)
        targets = soft_targets(labels, model.head.out_features, settings.label_smoothing)  # [N, classes]
        images, targets = mix_batch(images, targets, mixup=settings.mixup, cutmix=settings.cutmix, rng=mixing)
        with autocast(settings.precision, device):
            logits = model(images)  # [N, classes]
        return soft_cross_entropy(logits.float(), targets).mean()

    fit(model, optimizer, lambda: loader, loss_of, epochs=settings.epochs, steps_per_epoch=len(loader),
        name="fine-tune")
    return model


@torch.no_grad()
def evaluate_classifier(model: nn.Module, dataset: Dataset, batch_size: int, device: torch.device) -> dict[str, float]:
    """Top-1 and top-5 accuracy on ``dataset``."""
    model.to(device).eval()
    logits, labels = [], []
    for images, targets in data_loader(dataset, batch_size=batch_size):
        logits.append(model(images.to(device)).float().cpu())
        labels.append(torch.as_tensor(targets))
    return topk_accuracy(torch.cat(logits), torch.cat(labels))

