"""A converged linear probe: multinomial logistic regression by L-BFGS on standardised features.

The default deciding evaluation for small sets (``make reproduce``): the features are standardised with the
training split's mean and standard deviation, the L2 penalty is chosen by k-fold cross-validation on the
training split only, and the classifier is refitted on the whole training split with it. L-BFGS runs to
convergence in float64, so the result measures the features, not how fast a probe trains (the SGD/LARS
probe of :mod:`vip_core.eval.linprobe` is the paper's protocol at ImageNet scale).

It holds every training feature in memory, in float64 (N x F x 8 bytes, logged when it starts), and each L-BFGS
iteration reads them all: a probe for small sets (``make reproduce``'s 2,500 training images: 10 MB of pooled
tokens, 61 MB of raw pixels), not for ImageNet (1.28 M x 9,216: 94 GB), which the streaming probe serves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

L2_GRID = (1e-4, 1e-3, 1e-2)


@dataclass(frozen=True)
class ProbeResult:
    """The probe's held-out accuracy, the penalty chosen, and whether each held-out example was right ``[N]``."""

    top1: float
    l2: float
    correct: torch.Tensor


def standardise(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both ``[N, F]`` splits scaled by the training split's per-feature mean and std (float64)."""
    train, test = train.double(), test.double()
    mean, std = train.mean(0), train.std(0, unbiased=False).clamp_min(1e-8)  # [F] each
    return (train - mean) / std, (test - mean) / std


def fit_logistic(features: torch.Tensor, labels: torch.Tensor, num_classes: int, l2: float,
                 max_iter: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``[F, C]`` and bias ``[C]`` minimising mean cross-entropy + ``l2 / 2 * ||W||²`` by L-BFGS."""
    weight = torch.zeros(features.shape[1], num_classes, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1, max_iter=max_iter, tolerance_grad=1e-6,
                                  tolerance_change=1e-10, history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        logits = features @ weight + bias  # [N, C]
        loss = torch.nn.functional.cross_entropy(logits, labels) + 0.5 * l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return weight.detach(), bias.detach()


def predict(weight: torch.Tensor, bias: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The predicted class ``[N]`` of each row of ``features: [N, F]``."""
    return (features @ weight + bias).argmax(dim=1)


def cross_validated_l2(features: torch.Tensor, labels: torch.Tensor, num_classes: int,
                       grid: tuple[float, ...] = L2_GRID, folds: int = 3, seed: int = 0) -> float:
    """The penalty of ``grid`` with the best mean held-out accuracy over ``folds`` folds (the smaller on a tie)."""
    if folds < 2:
        raise ValueError(f"folds must be >= 2, got {folds}")
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    parts = order.chunk(folds)
    scores = []
    for l2 in grid:
        right = 0
        for k, held in enumerate(parts):
            kept = torch.cat([part for j, part in enumerate(parts) if j != k])
            weight, bias = fit_logistic(features[kept], labels[kept], num_classes, l2)
            right += int((predict(weight, bias, features[held]) == labels[held]).sum())
        scores.append(right / len(labels))
    logger.info("probe cross-validation: %s", dict(zip(grid, scores)))
    return grid[max(range(len(grid)), key=lambda i: (scores[i], -grid[i]))]


def converged_probe(train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor],
                    num_classes: int, grid: tuple[float, ...] = L2_GRID, folds: int = 3, seed: int = 0) -> ProbeResult:
    """Standardise, choose the penalty by cross-validation on ``train``, refit, score on ``test``.

    Args:
        train: ``(features [N, F], labels [N])``.
        test: ``(features [M, F], labels [M])``.
        num_classes: the number of classes.
        grid: the candidate L2 penalties.
        folds: cross-validation folds on the training split.
        seed: the folds' shuffle.
    """
    logger.info("converged probe: %d x %d training features in memory in float64 (%.0f MB)", *train[0].shape,
                train[0].numel() * 8 / 1024**2)
    train_x, test_x = standardise(train[0], test[0])
    l2 = cross_validated_l2(train_x, train[1], num_classes, grid, folds, seed)
    weight, bias = fit_logistic(train_x, train[1], num_classes, l2)
    correct = predict(weight, bias, test_x) == test[1]  # [M]
    return ProbeResult(top1=correct.double().mean().item(), l2=l2, correct=correct)
