"""The training loop: it stops before a step would pass the ε budget and checkpoints every period and at the end."""

from __future__ import annotations

import pytest

from vip_core.privacy.accounting import compute_epsilon
from vip_core.train.loop import run_steps


def test_the_loop_stops_before_a_step_would_pass_the_target_epsilon(regression):
    eps_after = [compute_epsilon(noise_multiplier=1.0, sample_rate=0.25, steps=s, delta=1e-3, accountant="rdp")
                 for s in range(1, 7)]
    target = (eps_after[2] + eps_after[3]) / 2  # three steps fit, the fourth would pass it
    step = regression.step(regression.plan(target))
    reports = []
    result = run_steps(step, regression.batch, regression.loss, until=6, on_step=reports.append)
    assert result.stopped_by_budget and result.steps == 3
    assert result.epsilon == pytest.approx(eps_after[2]) and result.epsilon <= target
    assert [r.epsilon for r in reports] == pytest.approx(eps_after[:3])


def test_checkpoints_come_every_period_and_at_the_end(regression):
    step = regression.step(regression.plan(100.0, steps=5))
    taken_at = []
    run_steps(step, regression.batch, regression.loss, until=5, checkpoint_every=2,
              on_checkpoint=lambda: taken_at.append(step.taken))
    assert taken_at == [2, 4, 5]
