"""The single-process private loop: budget stop, checkpoints that resume the ledger, the same q everywhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vip_core.config import get_preset, with_overrides
from vip_core.models.checkpoint import load_checkpoint
from vip_core.models.mae import build_mae
from vip_core.privacy.accounting import compute_epsilon
from vip_core.privacy.plan import PrivacyPlan
from vip_core.train.loop import build_state, mae_index_loss, train_private

DATASET = torch.randn(64, 6)
TARGETS = torch.randn(64, 1)


def regression_loss(model: nn.Module, indices: torch.Tensor) -> torch.Tensor:
    return (model(DATASET[indices]) - TARGETS[indices]).square().sum(-1)  # [b]


def make_plan(target_epsilon: float, sigma: float = 1.0, batch: int = 16, steps: int = 6) -> PrivacyPlan:
    q, delta = batch / len(DATASET), 1e-3
    epsilon = compute_epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=delta, accountant="rdp")
    return PrivacyPlan(
        dataset_size=len(DATASET), batch_size=batch, sample_rate=q, steps=steps, delta=delta, noise_multiplier=sigma,
        max_grad_norm=1.0, target_epsilon=target_epsilon, epsilon=epsilon, accountant="rdp",
    )


def make_config(steps: int = 6, checkpoint_every: int = 2):
    return with_overrides(
        get_preset("tiny"),
        {"private.steps": steps, "private.batch_size": 16, "private.physical_batch_size": 4,
         "private.checkpoint_every": checkpoint_every, "private.warmup_steps": 1},
    )


def fresh_state(plan: PrivacyPlan, config, seed: int = 0):
    torch.manual_seed(seed)
    return build_state(nn.Linear(6, 1), plan, config.private, seed=seed)


def test_the_loop_stops_before_a_step_would_pass_the_target_epsilon():
    eps_after = [compute_epsilon(noise_multiplier=1.0, sample_rate=0.25, steps=s, delta=1e-3, accountant="rdp")
                 for s in range(1, 7)]
    target = (eps_after[2] + eps_after[3]) / 2  # three steps fit, the fourth would pass it
    config = make_config()
    plan = make_plan(target)
    result = train_private(fresh_state(plan, config), regression_loss, plan, config)
    assert result.stopped_by_budget
    assert result.steps == 3
    assert result.epsilon == pytest.approx(eps_after[2]) and result.epsilon <= target
    assert [r.epsilon for r in result.reports] == pytest.approx(eps_after[:3])


def test_every_checkpoint_holds_the_ledger_and_resuming_continues_it_exactly(tmp_path):
    config, plan = make_config(steps=6, checkpoint_every=2), make_plan(target_epsilon=100.0)
    straight = fresh_state(plan, config)
    train_private(straight, regression_loss, plan, config)

    def crash_at_step_five(report):
        if report.step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_private(fresh_state(plan, config), regression_loss, plan, config, output=tmp_path, on_step=crash_at_step_five)
    saved = load_checkpoint(tmp_path)
    assert {"model", "config", "stage", "step", "optimizer", "ledger", "sampler", "rng"} <= set(saved)
    assert saved["step"] == 4 and saved["ledger"]["steps"] == 4
    assert saved["ledger"]["sample_rate"] == saved["sampler"]["sample_rate"] == plan.sample_rate

    resumed = fresh_state(plan, config, seed=99)  # different streams: the checkpoint must restore them
    second = train_private(resumed, regression_loss, plan, config, output=tmp_path, resume=True)
    assert second.steps == 6 and resumed.ledger.steps == 6 and len(second.reports) == 2
    assert second.epsilon == pytest.approx(straight.ledger.epsilon)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_sampler_and_ledger_share_the_plans_q():
    plan = make_plan(target_epsilon=100.0)
    state = fresh_state(plan, make_config())
    assert state.sampler.sample_rate == state.ledger.sample_rate == plan.sample_rate
    assert state.sampler.expected_batch_size == plan.batch_size


def test_mae_trains_privately_with_its_tokens_and_reports_epsilon_each_step(tmp_path):
    config = make_config(steps=2)
    images = torch.randn(64, 3, 32, 32)
    plan = make_plan(target_epsilon=100.0, steps=2)
    torch.manual_seed(0)
    state = build_state(build_mae(config.model), plan, config.private, seed=0)
    before = {n: p.detach().clone() for n, p in state.model.named_parameters() if p.requires_grad}
    seen = []
    result = train_private(
        state, mae_index_loss(lambda idx: images[idx], state.masking), plan, config, output=tmp_path, on_step=seen.append
    )
    assert result.steps == 2 and [r.step for r in seen] == [1, 2] and all(r.epsilon > 0 for r in seen)
    for name in ("cls_token", "mask_token", "patch_embed.proj.weight", "blocks.0.norm1.weight"):
        assert not torch.equal(before[name], dict(state.model.named_parameters())[name]), name
