"""The training step: an exact resume of the ledger, the streams and the weights, one q for sampler and
ledger, every MAE parameter trained with ε each step, and the plain (DP-off) step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from vip_core.config import get_preset
from vip_core.models.mae import build_mae
from vip_core.privacy.accounting import compute_epsilon
from vip_core.train.loop import run_steps
from vip_core.train.schedule import Schedule
from vip_core.privacy.engine import UnsupportedLayerError
from vip_core.train.step import PlainStep, PrivateStep


def test_resuming_from_a_checkpoint_continues_the_ledger_the_streams_and_the_weights_exactly(regression):
    plan = regression.plan(100.0)
    first = regression.step(plan)
    run_steps(first, regression.batch, regression.loss, until=4)
    state, streams, weights = first.state_dict(), first.stream_state(), first.model.state_dict()

    def resume(with_streams: bool) -> PrivateStep:
        step = regression.step(plan, seed=99)  # fresh entropy and other weights: the checkpoint must restore both
        step.model.load_state_dict(weights)
        step.load_state_dict(copy.deepcopy(state), streams if with_streams else None)  # as if read from disk
        result = run_steps(step, regression.batch, regression.loss, until=6)
        assert result.steps == 6 and step.ledger.steps == 6
        assert result.epsilon == pytest.approx(compute_epsilon(noise_multiplier=1.0, sample_rate=0.25, steps=6,
                                                               delta=1e-3, accountant="rdp"))
        return step

    once, twice, fresh = resume(True), resume(True), resume(False)
    flat = [torch.cat([p.detach().reshape(-1) for p in s.model.parameters()]) for s in (once, twice, fresh)]
    assert torch.equal(flat[0], flat[1])  # the restored streams drove the last two steps
    assert not torch.equal(flat[0], flat[2])


def test_sampler_and_ledger_share_the_plans_q(regression):
    plan = regression.plan(100.0)
    step = regression.step(plan)
    assert step.sampler.sample_rate == step.ledger.sample_rate == plan.sample_rate
    assert step.sampler.dataset_size == plan.dataset_size


def test_mae_trains_privately_with_its_tokens_and_reports_epsilon_each_step(regression):
    config = get_preset("tiny")
    images = torch.randn(64, 3, 32, 32)
    plan = regression.plan(100.0, steps=2)
    torch.manual_seed(0)
    mae = build_mae(config.model)
    step = PrivateStep(mae, plan, Schedule(peak_lr=1e-3, total_steps=2), physical_batch_size=8)
    before = {n: p.detach().clone() for n, p in mae.named_parameters() if p.requires_grad}
    seen = []
    result = run_steps(step, lambda idx, stream: (idx, stream.uniform((len(idx), mae.num_patches))),
                       lambda model, inputs: model(images[inputs[0]], noise=inputs[1])[0], until=2,
                       on_step=seen.append)
    assert result.steps == 2 and [r.step for r in seen] == [1, 2] and all(r.epsilon > 0 for r in seen)
    for name in ("cls_token", "mask_token", "patch_embed.proj.weight", "blocks.0.norm1.weight"):
        assert not torch.equal(before[name], dict(mae.named_parameters())[name]), name


def test_the_plain_step_follows_the_mean_gradient_and_is_deterministic_for_its_seed(regression):
    def run() -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Linear(6, 1)
        step = PlainStep(model, Schedule(peak_lr=0.1, total_steps=3), seed=5, local_size=64, sample_rate=0.25,
                         physical_batch_size=4)
        result = run_steps(step, regression.batch, regression.loss, until=3)
        assert result.epsilon is None and not result.stopped_by_budget
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    assert torch.equal(run(), run())


def test_a_parameter_the_optimiser_holds_and_the_engine_did_not_privatize_is_refused_before_it_is_trained(regression):
    """A listing that changes between calls gave the optimiser a parameter the engine never saw: AdamW applied the
    stale gradient it held (from a non-private backward), unclipped and un-noised."""
    plan = regression.plan(100.0)
    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    extra = nn.Parameter(torch.zeros(1))
    extra.grad = torch.ones(1)  # a stale, non-private gradient
    groups = [{"params": [model.weight, model.bias, extra], "weight_decay": 0.0}]
    step = PrivateStep(model, plan, Schedule(peak_lr=0.1, total_steps=plan.steps), physical_batch_size=4,
                       param_groups=groups)
    with pytest.raises(UnsupportedLayerError, match=r"optimiser holds parameter '\(unnamed\) \[1\]'"):
        run_steps(step, regression.batch, regression.loss, until=1)
    assert float(extra.detach()) == 0.0


def test_a_frozen_parameter_the_optimiser_holds_keeps_its_value(regression):
    """Frozen after a non-private backward, with the optimiser built before: its stale gradient was applied."""
    plan = regression.plan(100.0)
    step = regression.step(plan)
    model = step.model
    regression.loss(model, torch.arange(8)).sum().backward()
    model.bias.requires_grad_(False)
    frozen = model.bias.detach().clone()
    run_steps(step, regression.batch, regression.loss, until=2)
    assert torch.equal(model.bias.detach(), frozen)


def test_a_parameter_an_observer_hands_the_optimiser_is_refused_before_it_is_trained(regression):
    """The check ran before the observer, which may add a parameter group, and the optimiser stepped after it."""
    step = regression.step(regression.plan(100.0))
    extra = nn.Parameter(torch.zeros(1))
    extra.grad = torch.ones(1)  # a stale, non-private gradient

    def observe(model: nn.Module) -> None:
        step.optimizer.add_param_group({"params": [extra], "weight_decay": 0.0})

    with pytest.raises(UnsupportedLayerError, match="optimiser holds parameter"):
        step(regression.batch, regression.loss, observe)
    assert float(extra.detach()) == 0.0


def test_a_gradient_an_observer_changes_is_refused_before_it_is_trained(regression):
    """An observer running a backward on private data added a non-private gradient to the privatized one."""
    step = regression.step(regression.plan(100.0))
    before = step.model.weight.detach().clone()

    def observe(model: nn.Module) -> None:
        regression.loss(model, torch.arange(8)).sum().backward()

    with pytest.raises(UnsupportedLayerError, match="'weight', whose privatized gradient was replaced or changed"):
        step(regression.batch, regression.loss, observe)
    assert torch.equal(step.model.weight.detach(), before)

