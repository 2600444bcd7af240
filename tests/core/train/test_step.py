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


def test_a_parameter_frozen_or_unfrozen_between_steps_is_planned_again(regression):
    """Frozen after a non-private backward, with the optimiser built before: its stale gradient must not be applied;
    unfrozen again, it is clipped and trained with the others."""
    plan = regression.plan(100.0)
    step = regression.step(plan)
    model = step.model
    regression.loss(model, torch.arange(8)).sum().backward()
    model.bias.requires_grad_(False)
    frozen = model.bias.detach().clone()
    run_steps(step, regression.batch, regression.loss, until=2)
    assert torch.equal(model.bias.detach(), frozen)
    model.bias.requires_grad_(True)
    run_steps(step, regression.batch, regression.loss, until=3)
    assert not torch.equal(model.bias.detach(), frozen)
