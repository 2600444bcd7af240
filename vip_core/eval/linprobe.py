"""Linear probe: a frozen encoder, BatchNorm without affine, one linear layer.

The protocol of MAE and ViP: the features are the mean-pooled patch tokens of the last k blocks
(:func:`vip_core.eval.features.pooled_block_features`), normalised by a ``BatchNorm1d(affine=False)``
and classified by a linear layer trained with LARS (or SGD) under a warmup-then-cosine schedule, no
weight decay. The encoder is frozen and the images are not augmented, so the features are computed once, and read
a batch at a time (:mod:`vip_core.eval.feature_store`): the probe's memory does not grow with the data set. As one
of several workers, each trains on its share of every global batch (:mod:`vip_core.eval.loading`) and scores its
block of the held-out split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

import torch
from torch import nn

from vip_core.eval.feature_store import Features, InMemoryFeatures
from vip_core.eval.features import TopK
from vip_core.eval.fit import EpochCheckpoint, fit
from vip_core.eval.loading import EpochBatches
from vip_core.eval.seeding import job_seed, seeded
from vip_core.train.data import partition_range
from vip_core.train.distributed import rank_and_world

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


def train_probe(train: Features, num_classes: int, settings: ProbeSettings, device: torch.device = torch.device("cpu"),
                checkpoint: EpochCheckpoint | None = None) -> nn.Module:
    """A trained probe head on ``train``'s features, read a batch at a time, trained on ``device``."""
    with seeded(job_seed(settings.seed, "head")):
        head = probe_head(train.dim, num_classes).to(device)
    lr = settings.lr * settings.batch_size / 256
    if settings.optimizer == "lars":
        optimizer = LARS(head.parameters(), lr=lr, weight_decay=0.0)
    else:
        optimizer = torch.optim.SGD(head.parameters(), lr=lr, momentum=0.9, weight_decay=0.0)
    sampler = EpochBatches(len(train), settings.batch_size, seed=settings.seed, name="probe order")

    def batches(epoch: int) -> Iterator[torch.Tensor]:
        shares = (torch.tensor([index for index, _ in share]) for share in sampler.set_epoch(epoch))
        return (share for share in shares if len(share) >= 2)  # BatchNorm needs two

    def loss_of(share: torch.Tensor) -> torch.Tensor:
        features = train.rows(share).to(device).float()  # [b, F]
        return nn.functional.cross_entropy(head(features), train.labels[share].to(device))

    fit(head, optimizer, batches, loss_of, epochs=settings.epochs, steps_per_epoch=len(sampler), name="linear probe",
        checkpoint=checkpoint)
    return head.eval()


@torch.no_grad()
def evaluate_probe(head: nn.Module, features: Features, batch_size: int = 4096,
                   device: torch.device = torch.device("cpu")) -> dict[str, float]:
    """Top-1 and top-5 accuracy of ``head`` on ``features``: this worker's block, summed over the workers."""
    head.eval()
    rank, world = rank_and_world()
    start, stop = partition_range(len(features), rank, world)
    scores = TopK()
    for rows in torch.arange(start, stop).split(batch_size):
        scores.add(head(features.rows(rows).to(device).float()), features.labels[rows])
    return scores.accuracy()


def linear_probe(train: Features | tuple[torch.Tensor, torch.Tensor], val: Features | tuple[torch.Tensor, torch.Tensor],
                 num_classes: int, settings: ProbeSettings, device: torch.device = torch.device("cpu"),
                 checkpoint: EpochCheckpoint | None = None) -> dict[str, float]:
    """Trains on ``train`` (features, or ``(features [N, F], labels [N])`` in memory); returns top-1/top-5 on
    ``val``."""
    train, val = (InMemoryFeatures(*split) if isinstance(split, tuple) else split for split in (train, val))
    head = train_probe(train, num_classes, settings, device, checkpoint)
    return evaluate_probe(head, val, settings.batch_size, device)
