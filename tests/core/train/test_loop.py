"""The training loop: it stops before a step would pass the ε budget and checkpoints every period and at the end."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vip_core.config import PrivacyConfig
from vip_core.privacy.accounting import compute_epsilon
from vip_core.privacy.plan import PrivacyPlan, plan_privacy
from vip_core.train.loop import run_steps
from vip_core.train.schedule import Schedule
from vip_core.train.step import PrivateStep

DATASET = torch.randn(64, 6)
TARGETS = torch.randn(64, 1)


def regression_loss(model: nn.Module, indices: torch.Tensor) -> torch.Tensor:
    return (model(DATASET[indices]) - TARGETS[indices]).square().sum(-1)  # [b]


def indices_only(indices, stream):
    return indices


def make_plan(target_epsilon: float, sigma: float = 1.0, batch: int = 16, steps: int = 6) -> PrivacyPlan:
    budget = PrivacyConfig(noise_multiplier=sigma, target_epsilon=1e9, max_grad_norm=1.0, delta=1e-3, accountant="rdp")
    plan = plan_privacy(budget, dataset_size=len(DATASET), batch_size=batch, steps=steps, fingerprint="regression")
    return PrivacyPlan.from_dict({**plan.to_dict(), "target_epsilon": target_epsilon})


def private_step(plan: PrivacyPlan, seed: int = 0) -> PrivateStep:
    torch.manual_seed(seed)
    return PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=plan.steps, warmup_steps=1),
                       physical_batch_size=4)


def test_the_loop_stops_before_a_step_would_pass_the_target_epsilon():
    eps_after = [compute_epsilon(noise_multiplier=1.0, sample_rate=0.25, steps=s, delta=1e-3, accountant="rdp")
                 for s in range(1, 7)]
    target = (eps_after[2] + eps_after[3]) / 2  # three steps fit, the fourth would pass it
    step = private_step(make_plan(target))
    reports = []
    result = run_steps(step, indices_only, regression_loss, until=6, on_step=reports.append)
    assert result.stopped_by_budget and result.steps == 3
    assert result.epsilon == pytest.approx(eps_after[2]) and result.epsilon <= target
    assert [r.epsilon for r in reports] == pytest.approx(eps_after[:3])


def test_checkpoints_come_every_period_and_at_the_end():
    step = private_step(make_plan(100.0, steps=5))
    taken_at = []
    run_steps(step, indices_only, regression_loss, until=5, checkpoint_every=2,
              on_checkpoint=lambda: taken_at.append(step.taken))
    assert taken_at == [2, 4, 5]
