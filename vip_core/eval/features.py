"""Frozen-encoder features: mean-pooled patch tokens of the last k blocks, concatenated; and top-k scores.

This is the representation the linear probe and the few-shot classifiers read (the ViP paper's
protocol): for each of the encoder's last ``k`` blocks, the patch tokens (class token excluded) are
averaged, and the ``k`` averages are concatenated into one ``k * D`` vector per image. The encoder runs on the
job's device, under bfloat16 autocast with ``precision="bf16"``; the features come back as float32 on the CPU.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch
from torch import nn
from torch.utils.data import Dataset

from vip_core.eval.loading import Loading
from vip_core.train.distributed import all_reduce_sum
from vip_core.train.precision import autocast

logger = logging.getLogger(__name__)


def pooled_block_features(encoder: nn.Module, images: torch.Tensor, last_blocks: int) -> torch.Tensor:
    """Mean-pooled patch tokens of the last ``last_blocks`` blocks, concatenated: ``[N, k * D]``."""
    depth = len(encoder.blocks)
    if not 0 < last_blocks <= depth:
        raise ValueError(f"evaluation.linprobe_last_blocks: {last_blocks} is not in 1..{depth} (encoder depth)")
    blocks = encoder.forward_intermediates(images, indices=last_blocks, output_fmt="NLC",
                                           intermediates_only=True)  # k x [N, L, D], patch tokens only
    return torch.cat([tokens.mean(dim=1) for tokens in blocks], dim=1)  # [N, k * D]


@torch.no_grad()
def feature_batches(encoder: nn.Module, dataset: Dataset, *, last_blocks: int, batch_size: int, loading: Loading,
                    precision: str = "fp32") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(features [b, k * D] float32, labels [b])`` of ``dataset``'s uint8 images in order, one batch at a time, on
    the CPU."""
    encoder.eval().to(loading.device)
    for images, targets in loading.in_order(dataset, batch_size):
        with autocast(precision, loading.device):
            features = pooled_block_features(encoder, loading.images(images), last_blocks)  # [b, k * D]
        yield features.float().cpu(), torch.as_tensor(targets)


def extract_features(encoder: nn.Module, dataset: Dataset, *, last_blocks: int, batch_size: int, loading: Loading,
                     precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Features and labels of every item of ``dataset``, in memory: ``([N, k * D], [N])`` on the CPU (for small
    sets; the linear probe streams them through :mod:`vip_core.eval.feature_store`)."""
    batches = list(feature_batches(encoder, dataset, last_blocks=last_blocks, batch_size=batch_size, loading=loading,
                                   precision=precision))
    logger.info("extracted features of %d images", sum(len(features) for features, _ in batches))
    return torch.cat([features for features, _ in batches]), torch.cat([labels for _, labels in batches])


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> dict[str, float]:
    """``{"top1": ..., "top5": ...}`` in [0, 1]; k is capped at the number of classes."""
    scores = TopK(ks)
    scores.add(logits, labels)
    return {name: hits / scores.count for name, hits in scores.hits.items()}


class TopK:
    """Top-k hits counted batch by batch; :meth:`accuracy` sums them over the workers."""

    def __init__(self, ks: tuple[int, ...] = (1, 5)) -> None:
        self.hits = {f"top{k}": 0 for k in ks}
        self.count = 0

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Counts the hits of ``logits: [b, C]`` against ``labels: [b]``."""
        labels = labels.to(logits.device)
        for name in self.hits:
            top = logits.topk(min(int(name[3:]), logits.shape[1]), dim=1).indices  # [b, k]
            self.hits[name] += int((top == labels[:, None]).any(dim=1).sum())
        self.count += len(labels)

    def accuracy(self) -> dict[str, float]:
        """Every worker's hits over every worker's examples."""
        count = all_reduce_sum(self.count)
        return {name: all_reduce_sum(hits) / count for name, hits in self.hits.items()}
