"""DP-AdamW: decoupled weight decay that spares biases and norms, one step per logical batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vip_core.config import get_preset
from vip_core.models.mae import build_mae
from vip_core.privacy.engine import privatized_gradients
from vip_core.privacy.optimizer import dp_adamw, set_learning_rate
from vip_core.privacy.randomness import RandomStream


def test_weight_decay_is_decoupled_and_spares_biases_and_norms():
    mae = build_mae(get_preset("tiny").model)
    optimizer = dp_adamw(mae, lr=1e-3, weight_decay=0.1)
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {n for n, p in mae.named_parameters() if id(p) in decayed}
    assert "cls_token" in names and "blocks.0.attn.qkv.weight" in names
    assert "blocks.0.attn.qkv.bias" not in names and "blocks.0.norm1.weight" not in names
    trainable = {id(p) for p in mae.parameters() if p.requires_grad}
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == trainable

    layer = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(2.0)
    optimizer = dp_adamw(layer, lr=0.5, weight_decay=0.1)
    layer.weight.grad = torch.zeros_like(layer.weight)
    optimizer.step()  # a zero gradient moves the weight by the decay alone: w ← w (1 − lr·wd)
    assert torch.allclose(layer.weight, torch.full_like(layer.weight, 2.0 * (1 - 0.5 * 0.1)))


def test_privatized_gradient_drives_one_adamw_step_per_logical_batch():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = dp_adamw(model, lr=0.1, weight_decay=0.0)
    set_learning_rate(optimizer, 0.01)
    before = model.weight.detach().clone()
    privatized_gradients(
        model, lambda m, x: m(x).sum(-1), torch.randn(10, 4), max_grad_norm=1.0, noise_multiplier=1.0,
        expected_batch_size=10, physical_batch_size=3, noise=RandomStream(0, 0, "noise"),
    )
    optimizer.step()
    assert optimizer.state[model.weight]["step"].item() == 1
    step = (model.weight - before).abs()
    assert torch.allclose(step, torch.full_like(step, 0.01), rtol=1e-3)  # Adam's first step is ±lr


def test_parameter_groups_that_leave_a_trainable_parameter_out_are_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"leave out trainable parameters: 1\.weight, 1\.bias"):
        dp_adamw(model, lr=0.1, param_groups=[{"params": list(model[0].parameters())}])


def test_the_schedule_scales_each_group_by_its_lr_scale():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizer = dp_adamw(model, lr=0.1, param_groups=[{"params": list(model[0].parameters()), "lr_scale": 0.5},
                                                      {"params": list(model[1].parameters())}])
    set_learning_rate(optimizer, 0.2)
    assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.2]
