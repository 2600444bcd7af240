"""Few-shot linear classifiers on frozen features: k examples per class, averaged over seeds.

For each k (1, 5, 10 by default) and each seed, k training images per class are drawn, a ridge
regression classifier (one-hot targets, closed form) is fitted on their standardised features, and top-1
accuracy is measured on the whole held-out split. The report gives the mean and
the standard deviation over seeds.
"""

from __future__ import annotations

import logging
import statistics

import torch
from torch import nn

from vip_core.eval.features import topk_accuracy

logger = logging.getLogger(__name__)


def sample_shots(labels: torch.Tensor, shots: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of ``shots`` random examples of every class (all of a class's examples if it has fewer)."""
    chosen = []
    for label in labels.unique():
        members = (labels == label).nonzero().squeeze(1)  # [M]
        chosen.append(members[torch.randperm(len(members), generator=generator)[:shots]])
    return torch.cat(chosen)


def fit_ridge_classifier(features: torch.Tensor, labels: torch.Tensor, num_classes: int, l2: float) -> nn.Linear:
    """A linear classifier by ridge regression onto one-hot targets: ``min ||X W + b - Y||^2 + l2 ||W||^2``.

    Closed form (one linear solve), so it is exact and deterministic. ``features: [N, F]`` should be centred.
    """
    targets = nn.functional.one_hot(labels, num_classes).to(features.dtype)  # [N, C]
    bias = targets.mean(0)  # [C]
    gram = features.T @ features + l2 * torch.eye(features.shape[1], dtype=features.dtype)  # [F, F]
    weight = torch.linalg.solve(gram, features.T @ (targets - bias))  # [F, C]
    classifier = nn.utils.skip_init(nn.Linear, features.shape[1], num_classes)  # no draw from the global generator
    with torch.no_grad():
        classifier.weight.copy_(weight.T)
        classifier.bias.copy_(bias)
    return classifier


def few_shot(train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor], num_classes: int,
             *, shots: tuple[int, ...], seeds: int, l2: float, seed: int = 0) -> dict[str, float]:
    """``{"1shot_top1": mean, "1shot_top1_std": std, ...}`` over ``seeds`` draws of each shot count."""
    train_features, train_labels = train
    val_features, val_labels = val
    result: dict[str, float] = {}
    for k in shots:
        accuracies = []
        for draw in range(seeds):
            generator = torch.Generator().manual_seed(seed * 1000 + draw)
            index = sample_shots(train_labels, k, generator)  # [k * C]
            mean = train_features[index].mean(0)
            std = train_features[index].std(0, unbiased=False) + 1e-6  # [F]
            classifier = fit_ridge_classifier((train_features[index] - mean) / std, train_labels[index],
                                              num_classes, l2)
            with torch.no_grad():
                logits = classifier((val_features - mean) / std)  # [N, C]
            accuracies.append(topk_accuracy(logits, val_labels, ks=(1,))["top1"])
        result[f"{k}shot_top1"] = statistics.fmean(accuracies)
        result[f"{k}shot_top1_std"] = statistics.pstdev(accuracies)
        logger.info("%d-shot top-1 over %d seeds: %s", k, seeds, accuracies)
    return result
