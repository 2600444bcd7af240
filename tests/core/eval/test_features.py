"""Frozen-encoder features and their metric: top-k accuracy against known answers."""

from __future__ import annotations

import torch

from vip_core.eval.features import topk_accuracy


def test_topk_accuracy_counts_a_hit_anywhere_in_the_top_k():
    logits = torch.tensor([[0.9, 0.1, 0.0, 0.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    labels = torch.tensor([0, 0])
    assert topk_accuracy(logits, labels) == {"top1": 0.5, "top5": 0.5}
    assert topk_accuracy(logits, torch.tensor([1, 2]))["top5"] == 1.0
