"""The linear probe's head trained with LARS or SGD separates separable features."""

from __future__ import annotations

import pytest
import torch

from vip_core.eval.linprobe import ProbeSettings, linear_probe


@pytest.mark.parametrize("optimizer", ["lars", "sgd"])
def test_probe_head_separates_separable_features(optimizer):
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(5, 32, generator=generator) * 3  # [C, F]
    labels = torch.arange(400) % 5
    features = centres[labels] + torch.randn(400, 32, generator=generator)  # [N, F]
    # a LARS step moves the weights by lr x 0.001 x ||w||: it needs MAE's large rates (6.4 at batch 16k)
    settings = ProbeSettings(epochs=10, lr=0.1 if optimizer == "sgd" else 200.0, batch_size=64, optimizer=optimizer)
    metrics = linear_probe((features[:300], labels[:300]), (features[300:], labels[300:]), 5, settings)
    assert metrics["top1"] > 0.85, metrics
