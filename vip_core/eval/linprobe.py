"""Linear probe: a frozen encoder, BatchNorm without affine, one linear layer.

The protocol of MAE and ViP: the features are the mean-pooled patch tokens of the last k blocks
(:func:`vip_core.eval.features.pooled_block_features`), normalised by a ``BatchNorm1d(affine=False)``
and classified by a linear layer trained with LARS (or SGD) under a warmup-then-cosine schedule, no
weight decay. The encoder is frozen and the images are not augmented, so the features are computed once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Literal

import torch
from torch import nn

from vip_core.eval.features import topk_accuracy
from vip_core.eval.fit import fit
from vip_core.eval.seeding import job_seed, seeded

class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling (You et al. 2017), as MAE's linear probe uses it.

    Each parameter's update is scaled by ``trust_coefficient * ||w|| / ||g + wd * w||``; 1-D parameters
    (biases, norm statistics) are updated without scaling or decay.
    """

    def __init__(self, params, lr: float = 0.0, weight_decay: float = 0.0, momentum: float = 0.9,
                 trust_coefficient: float = 0.001) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                update = param.grad
                if param.ndim > 1:
                    update = update.add(param, alpha=group["weight_decay"])
                    param_norm, update_norm = torch.norm(param), torch.norm(update)
                    ratio = torch.where((param_norm > 0) & (update_norm > 0),
                                        group["trust_coefficient"] * param_norm / update_norm, torch.ones_like(param_norm))
                    update = update.mul(ratio)
                state = self.state[param]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(param)
                mu = state["mu"].mul_(group["momentum"]).add_(update)
                param.add_(mu, alpha=-group["lr"])


def probe_head(in_features: int, num_classes: int) -> nn.Sequential:
    """``BatchNorm1d(affine=False)`` then a linear layer (weights ~ N(0, 0.01), bias 0), as in MAE."""
    linear = nn.Linear(in_features, num_classes)
    nn.init.trunc_normal_(linear.weight, std=0.01)
    nn.init.zeros_(linear.bias)
    return nn.Sequential(nn.BatchNorm1d(in_features, affine=False, eps=1e-6), linear)


@dataclass(frozen=True)
class ProbeSettings:
    """Training settings of the linear head. ``lr`` is the base rate per 256 examples."""

    epochs: int
    lr: float
    batch_size: int
    optimizer: Literal["lars", "sgd"] = "lars"
    seed: int = 0


def train_probe(features: torch.Tensor, labels: torch.Tensor, num_classes: int, settings: ProbeSettings) -> nn.Module:
    """A trained probe head on ``features: [N, F]`` and ``labels: [N]``."""
    generator = torch.Generator().manual_seed(settings.seed)
    with seeded(job_seed(settings.seed, "head")):
        head = probe_head(features.shape[1], num_classes)
    lr = settings.lr * settings.batch_size / 256
    if settings.optimizer == "lars":
        optimizer = LARS(head.parameters(), lr=lr, weight_decay=0.0)
    else:
        optimizer = torch.optim.SGD(head.parameters(), lr=lr, momentum=0.9, weight_decay=0.0)

    def batches() -> Iterator[torch.Tensor]:
        order = torch.randperm(len(features), generator=generator)
        return (batch for batch in order.split(settings.batch_size) if len(batch) >= 2)  # BatchNorm needs two

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(head(features[batch]), labels[batch])  # features: [B, F]

    fit(head, optimizer, batches, loss_of, epochs=settings.epochs,
        steps_per_epoch=math.ceil(len(features) / settings.batch_size), name="linear probe")
    return head.eval()


@torch.no_grad()
def evaluate_probe(head: nn.Module, features: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Top-1 and top-5 accuracy of ``head`` on ``features: [N, F]``."""
    return topk_accuracy(head.eval()(features), labels)


def linear_probe(train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor],
                 num_classes: int, settings: ProbeSettings) -> dict[str, float]:
    """Trains on ``train = (features, labels)``; returns top-1/top-5 on ``val``."""
    head = train_probe(*train, num_classes, settings)
    return evaluate_probe(head, *val)
