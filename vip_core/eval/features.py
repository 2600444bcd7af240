"""Frozen-encoder features: mean-pooled patch tokens of the last k blocks, concatenated.

This is the representation the linear probe and the few-shot classifiers read (the ViP paper's
protocol): for each of the encoder's last ``k`` blocks, the patch tokens (class token excluded) are
averaged, and the ``k`` averages are concatenated into one ``k * D`` vector per image.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.data import Dataset

from vip_core.eval.seeding import data_loader

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    """CUDA when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pooled_block_features(encoder: nn.Module, images: torch.Tensor, last_blocks: int) -> torch.Tensor:
    """Mean-pooled patch tokens of the last ``last_blocks`` blocks, concatenated: ``[N, k * D]``."""
    depth = len(encoder.blocks)
    if not 0 < last_blocks <= depth:
        raise ValueError(f"evaluation.linprobe_last_blocks: {last_blocks} is not in 1..{depth} (encoder depth)")
    blocks = encoder.forward_intermediates(images, indices=last_blocks, output_fmt="NLC",
                                           intermediates_only=True)  # k x [N, L, D], patch tokens only
    return torch.cat([tokens.mean(dim=1) for tokens in blocks], dim=1)  # [N, k * D]


@torch.no_grad()
def extract_features(
    encoder: nn.Module, dataset: Dataset, *, last_blocks: int, batch_size: int, device: torch.device,
    num_workers: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and labels of every item of ``dataset``: ``([N, k * D], [N])`` on the CPU."""
    encoder.eval().to(device)
    loader = data_loader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    features, labels = [], []
    for images, targets in loader:
        features.append(pooled_block_features(encoder, images.to(device), last_blocks).float().cpu())
        labels.append(torch.as_tensor(targets))
    logger.info("extracted features of %d images", sum(len(f) for f in features))
    return torch.cat(features), torch.cat(labels)


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> dict[str, float]:
    """``{"top1": ..., "top5": ...}`` in [0, 1]; k is capped at the number of classes."""
    result = {}
    for k in ks:
        top = logits.topk(min(k, logits.shape[1]), dim=1).indices  # [N, k]
        result[f"top{k}"] = (top == labels[:, None]).any(dim=1).float().mean().item()
    return result
