"""Few-shot linear classifiers on frozen features: k examples per class, averaged over seeds.

For each k (1, 5, 10 by default) and each seed, k training images per class are drawn, a ridge
regression classifier (one-hot targets, closed form) is fitted on their standardised features, and top-1
accuracy is measured on the whole held-out split. The report gives the mean and
the standard deviation over seeds. Only the drawn training images are encoded, and the held-out split's features
are scored a batch at a time by every classifier: the memory does not grow with either split.
"""

from __future__ import annotations

import logging
import statistics
from typing import Callable, Iterable

import torch
from torch import nn

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


def few_shot(train_labels: torch.Tensor, features_of: Callable[[torch.Tensor], torch.Tensor],
             val: Iterable[tuple[torch.Tensor, torch.Tensor]], num_classes: int, *, shots: tuple[int, ...], seeds: int,
             l2: float, seed: int = 0) -> dict[str, float]:
    """``{"1shot_top1": mean, "1shot_top1_std": std, ...}`` over ``seeds`` draws of each shot count.

    Args:
        train_labels: ``[N]`` labels of the training split.
        features_of: ``[M, F]`` features of training images ``indices: [M]``.
        val: the held-out split's ``(features [b, F], labels [b])``, a batch at a time.
        num_classes: the number of classes.
        shots: the shot counts k.
        seeds: draws of each k.
        l2: the ridge penalty.
        seed: the draws' seed.
    """
    draws = {(k, draw): sample_shots(train_labels, k, torch.Generator().manual_seed(seed * 1000 + draw))
             for k in shots for draw in range(seeds)}  # each [k * C]
    wanted = torch.unique(torch.cat(list(draws.values())))  # [M], ascending
    rows = features_of(wanted)  # [M, F]
    classifiers = {}
    for key, index in draws.items():
        shot = rows[torch.searchsorted(wanted, index)]  # [k * C, F]
        mean, std = shot.mean(0), shot.std(0, unbiased=False) + 1e-6  # [F]
        classifiers[key] = (mean, std, fit_ridge_classifier((shot - mean) / std, train_labels[index], num_classes, l2))
    hits, count = dict.fromkeys(draws, 0), 0
    with torch.no_grad():
        for features, labels in val:  # features: [b, F]
            for key, (mean, std, classifier) in classifiers.items():
                hits[key] += int((classifier((features - mean) / std).argmax(1) == labels).sum())
            count += len(labels)
    result: dict[str, float] = {}
    for k in shots:
        accuracies = [hits[(k, draw)] / count for draw in range(seeds)]
        result[f"{k}shot_top1"] = statistics.fmean(accuracies)
        result[f"{k}shot_top1_std"] = statistics.pstdev(accuracies)
        logger.info("%d-shot top-1 over %d seeds: %s", k, seeds, accuracies)
    return result
