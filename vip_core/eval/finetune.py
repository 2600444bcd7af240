"""End-to-end fine-tuning with layer-wise learning-rate decay, without or with differential privacy.

The classifier is the encoder, its patch tokens mean-pooled, a LayerNorm and a linear head (MAE's
fine-tuning model). AdamW trains every trainable parameter; block ``i`` of a depth-``L`` encoder learns
at ``lr * decay ** (L + 1 - (i + 1))``, the embeddings at ``lr * decay ** (L + 1)``, the head at ``lr``.

DP fine-tuning (:func:`dp_finetune`) treats the fine-tuning set as private: each logical step draws a
Poisson sample at rate ``q = B / N``, gets the privatized gradient from
:func:`vip_core.privacy.engine.privatized_gradients` (per-sample clipping to C, Gaussian noise σC, divided
by B), and the accountant reports ε for δ after the planned steps, σ being calibrated to the target ε
unless given. This guarantee covers the fine-tuning data; pre-training data has its own.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from vip_core.eval.features import topk_accuracy
from vip_core.eval.fit import FitSettings, fit, layer_decay_adamw, warmup_cosine_schedule

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
    """Fine-tuning hyperparameters. ``lr`` is the base rate per 256 examples of the (expected) batch."""

    num_workers: int = 0


@dataclass(frozen=True)
class DPSettings:
    """DP fine-tuning: ``steps`` logical steps of expected batch ``batch_size`` (q = batch_size / N)."""

    target_epsilon: float
    delta: float | None
    max_grad_norm: float
    noise_multiplier: float | None
    batch_size: int
    physical_batch_size: int
    steps: int
    accountant: str = "prv"


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
    torch.manual_seed(settings.seed)
    loader = DataLoader(train, batch_size=settings.batch_size, shuffle=True, drop_last=len(train) > settings.batch_size,
                        num_workers=settings.num_workers)
    optimizer = fine_tuning_adamw(model, settings, settings.batch_size)
    model.to(device)

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch  # [N, 3, S, S], [N]
        return nn.functional.cross_entropy(model(images.to(device)), labels.to(device))

    fit(model, optimizer, lambda: loader, loss_of, epochs=settings.epochs, steps_per_epoch=len(loader),
        name="fine-tune")
    return model


def per_sample_cross_entropy(model: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One loss per example: ``[B]``."""
    images, labels = inputs
    return nn.functional.cross_entropy(model(images), labels, reduction="none")


def _gather(dataset: Dataset, indices: torch.Tensor, like: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(indices) == 0:
        return torch.empty(0, *like[0].shape), torch.empty(0, dtype=torch.int64)
    items = [dataset[int(i)] for i in indices]
    return torch.stack([image for image, _ in items]), torch.tensor([label for _, label in items])


def plan_dp(settings: DPSettings, dataset_size: int) -> dict[str, float]:
    """Sample rate, δ, σ and the ε the accountant reports for the planned steps."""
    from vip_core.privacy.accounting import calibrate_noise_multiplier, compute_epsilon

    if settings.batch_size > dataset_size:
        raise ValueError(f"evaluation.finetune_privacy.batch_size {settings.batch_size} exceeds the "
                         f"{dataset_size} fine-tuning images")
    sample_rate = settings.batch_size / dataset_size
    delta = settings.delta if settings.delta is not None else 1.0 / (2 * dataset_size)
    accounting = dict(sample_rate=sample_rate, steps=settings.steps, delta=delta, accountant=settings.accountant)
    sigma = settings.noise_multiplier
    if sigma is None:
        sigma = calibrate_noise_multiplier(target_epsilon=settings.target_epsilon, **accounting)
    epsilon = compute_epsilon(noise_multiplier=sigma, **accounting)
    if epsilon > settings.target_epsilon * (1 + 1e-6):
        raise ValueError(f"evaluation.finetune_privacy.noise_multiplier: σ = {sigma} over {settings.steps} steps "
                         f"spends ε = {epsilon:.3f}, above the target {settings.target_epsilon}")
    return {"sample_rate": sample_rate, "delta": delta, "noise_multiplier": sigma, "epsilon": epsilon,
            "steps": settings.steps, "max_grad_norm": settings.max_grad_norm}


def dp_finetune(model: EncoderClassifier, train: Dataset, settings: FinetuneSettings, dp: DPSettings,
                plan: dict[str, float], device: torch.device) -> EncoderClassifier:
    """DP fine-tuning through the DP engine with the privacy ``plan`` of :func:`plan_dp` for ``train``."""
    from vip_core.privacy.engine import privatized_gradients
    from vip_core.privacy.sampling import PoissonSampler
    from vip_core.train.data import stream_generator

    torch.manual_seed(settings.seed)
    # The sample and the noise must be unpredictable: fresh OS entropy, never the public config seed.
    entropy = secrets.randbits(63)
    sampling_stream = stream_generator(entropy, 0, "sampling")
    noise_stream = stream_generator(entropy, 0, "noise")
    batches: Iterator[torch.Tensor] = iter(PoissonSampler(len(train), plan["sample_rate"], sampling_stream))
    optimizer, schedule = build_optimizer(model, settings, dp.batch_size, dp.steps)
    model.to(device).train()
    example = train[0]
    for step in range(dp.steps):
        images, labels = _gather(train, next(batches), example)  # [b, 3, S, S], [b]
        optimizer.zero_grad(set_to_none=True)
        privatized_gradients(
            model, per_sample_cross_entropy, (images.to(device), labels.to(device)),
            max_grad_norm=dp.max_grad_norm, noise_multiplier=plan["noise_multiplier"],
            expected_batch_size=dp.batch_size, physical_batch_size=dp.physical_batch_size, generator=noise_stream,
        )
        optimizer.step()
        schedule.step()
        if step % max(1, dp.steps // 5) == 0:
            logger.info("DP fine-tune step %d/%d: %d examples sampled", step + 1, dp.steps, len(labels))
    return model


@torch.no_grad()
def evaluate_classifier(model: nn.Module, dataset: Dataset, batch_size: int, device: torch.device) -> dict[str, float]:
    """Top-1 and top-5 accuracy on ``dataset``."""
    model.to(device).eval()
    logits, labels = [], []
    for images, targets in DataLoader(dataset, batch_size=batch_size):
        logits.append(model(images.to(device)).float().cpu())
        labels.append(torch.as_tensor(targets))
    return topk_accuracy(torch.cat(logits), torch.cat(labels))

