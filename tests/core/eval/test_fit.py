"""The one fitting routine of the evaluation jobs: layer-wise lr decay of the optimiser groups, the
warmup-cosine schedule, and the epoch loop that steps both once per batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vip_core.config import tiny
from vip_core.eval.finetune import EncoderClassifier
from vip_core.eval.fit import fit, layer_decay_adamw, layer_decay_param_groups, warmup_cosine_schedule
from vip_core.models import build_encoder


def test_layer_decay_gives_the_head_full_lr_and_earlier_blocks_less():
    model = EncoderClassifier(build_encoder(tiny().model), num_classes=3)
    depth = len(model.encoder.blocks)
    groups = layer_decay_param_groups(model, "encoder.", depth, lr=1.0, weight_decay=0.05, layer_decay=0.5)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    decay_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert lr_of[id(model.head.weight)] == 1.0
    assert lr_of[id(model.encoder.blocks[-1].mlp.fc1.weight)] == 0.5
    assert lr_of[id(model.encoder.blocks[0].mlp.fc1.weight)] == 0.5 ** depth
    assert lr_of[id(model.encoder.patch_embed.proj.weight)] == 0.5 ** (depth + 1)
    assert decay_of[id(model.encoder.blocks[0].mlp.fc1.weight)] == 0.05
    assert decay_of[id(model.encoder.blocks[0].mlp.fc1.bias)] == 0.0
    assert decay_of[id(model.encoder.cls_token)] == 0.0
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert set(lr_of) == trainable, "every trainable parameter is in exactly one group"


def test_layer_decay_adamw_finds_the_encoder_by_its_prefix():
    model = EncoderClassifier(build_encoder(tiny().model), num_classes=3)
    optimizer = layer_decay_adamw(model, "encoder.", lr=1.0, weight_decay=0.05, layer_decay=0.5)
    depth = len(model.encoder.blocks)
    assert sorted({group["lr"] for group in optimizer.param_groups}) == [0.5 ** k for k in range(depth + 1, -1, -1)]


def test_the_schedule_warms_up_over_a_tenth_then_decays_to_zero():
    optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=1.0)
    schedule = warmup_cosine_schedule(optimizer, total_steps=100)
    rates = []
    for _ in range(100):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert rates[10:] == sorted(rates[10:], reverse=True) and rates[-1] < 0.001


def test_fit_takes_one_step_per_batch_and_learns():
    torch.manual_seed(0)
    inputs = torch.randn(64, 3)  # [N, 3]
    targets = inputs @ torch.tensor([1.0, -2.0, 0.5])  # [N]
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(inputs[batch]).squeeze(1), targets[batch])

    before = loss_of(torch.arange(64)).item()
    last = fit(model, optimizer, lambda epoch: torch.randperm(64).split(16), loss_of, epochs=20, steps_per_epoch=4, name="toy")
    assert last < before / 20 and model.training
    assert optimizer.param_groups[0]["lr"] < 1e-3, "80 batches took the schedule to its end"
