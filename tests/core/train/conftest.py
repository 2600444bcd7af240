"""The smallest private training task, shared by the step's and the loop's tests: a linear regression on
64 samples of 6 features."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vip_core.config import PrivacyConfig
from vip_core.privacy.plan import PrivacyPlan, plan_privacy
from vip_core.train.schedule import Schedule
from vip_core.train.step import PrivateStep


class RegressionTask:
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(64, 6, generator=generator)  # [N, 6]
        self.targets = torch.randn(64, 1, generator=generator)  # [N, 1]

    def loss(self, model: nn.Module, indices: torch.Tensor) -> torch.Tensor:
        return (model(self.inputs[indices]) - self.targets[indices]).square().sum(-1)  # [b]

    @staticmethod
    def batch(indices: torch.Tensor, stream) -> torch.Tensor:
        return indices

    def plan(self, target_epsilon: float, sigma: float = 1.0, batch: int = 16, steps: int = 6) -> PrivacyPlan:
        budget = PrivacyConfig(noise_multiplier=sigma, target_epsilon=1e9, max_grad_norm=1.0, delta=1e-3,
                               accountant="rdp")
        plan = plan_privacy(budget, dataset_size=len(self.inputs), batch_size=batch, steps=steps,
                            fingerprint="regression")
        return PrivacyPlan.from_dict({**plan.to_dict(), "target_epsilon": target_epsilon})

    @staticmethod
    def step(plan: PrivacyPlan, seed: int = 0) -> PrivateStep:
        torch.manual_seed(seed)
        return PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=plan.steps, warmup_steps=1),
                           physical_batch_size=4)


@pytest.fixture
def regression() -> RegressionTask:
    return RegressionTask()
