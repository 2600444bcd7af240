"""The learning-rate schedule in logical steps: warmup then cosine, or constant."""

from __future__ import annotations

import math

import pytest

from vip_core.train.schedule import lr_at


def test_warmup_rises_linearly_then_cosine_decays_to_min_lr():
    kwargs = dict(peak_lr=1.0, total_steps=10, warmup_steps=4, min_lr=0.1)
    rates = [lr_at(s, **kwargs) for s in range(10)]
    assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert rates[4] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(rates[4:], rates[5:]))
    assert lr_at(7, **kwargs) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 6)))
    assert lr_at(10, **kwargs) == pytest.approx(0.1) and lr_at(50, **kwargs) == pytest.approx(0.1)


def test_constant_schedule_and_bad_arguments():
    assert lr_at(9, peak_lr=0.3, total_steps=10, schedule="constant") == 0.3
    with pytest.raises(ValueError):
        lr_at(-1, peak_lr=1.0, total_steps=10)
    with pytest.raises(ValueError):
        lr_at(0, peak_lr=1.0, total_steps=10, schedule="linear")
