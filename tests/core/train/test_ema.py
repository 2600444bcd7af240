"""The moving average of the weights (``ema_decay``): the average of the sequence of weights a private run
releases, computed from them alone."""

from __future__ import annotations

import pytest
import torch

from vip_core.train.ema import WeightAverage
from vip_core.train.loop import run_steps

DECAY = 0.9


def released_weights_and_average(regression, scramble_private: bool) -> tuple[list[dict], WeightAverage]:
    """The weights a private run of 4 steps releases (its initial weights first) and its moving average, updated
    after every step; with ``scramble_private``, each update sees random gradients and AdamW moments (what the step
    holds besides the weights)."""
    step = regression.step(regression.plan(target_epsilon=1e9))
    released = [{name: value.clone() for name, value in step.model.state_dict().items()}]
    average = WeightAverage(step.model, DECAY)

    def after_step(report) -> None:
        kept = [(param, param.grad, dict(step.optimizer.state[param])) for param in step.model.parameters()]
        if scramble_private:  # for the update only: the next step sees them as they were
            for param, _, moments in kept:
                param.grad = torch.randn_like(param)
                step.optimizer.state[param] = {key: torch.randn_like(value) for key, value in moments.items()}
        average.update(step.model)
        for param, grad, moments in kept:
            param.grad, step.optimizer.state[param] = grad, moments
        released.append({name: value.clone() for name, value in step.model.state_dict().items()})

    run_steps(step, regression.batch, regression.loss, until=4, on_step=after_step)
    return released, average


def test_the_average_is_the_recomputed_average_of_the_released_weights(regression):
    released, average = released_weights_and_average(regression, scramble_private=False)
    for name, value in average.state_dict().items():
        expected = released[0][name].double()
        for weights in released[1:]:
            expected = DECAY * expected + (1 - DECAY) * weights[name].double()
        assert torch.allclose(value.double(), expected, rtol=0, atol=1e-6)
        assert not torch.allclose(value, released[-1][name])


def test_the_average_reads_the_released_weights_and_nothing_else_of_a_step(regression, monkeypatch):
    monkeypatch.setattr("vip_core.train.step.private_entropy", lambda: 2**90 + 3)  # the same run twice
    _, plain = released_weights_and_average(regression, scramble_private=False)
    _, scrambled = released_weights_and_average(regression, scramble_private=True)
    for name, value in plain.state_dict().items():
        assert torch.equal(scrambled.state_dict()[name], value)


def test_a_resumed_average_continues_the_same_sequence(regression):
    released, average = released_weights_and_average(regression, scramble_private=False)
    model = regression.step(regression.plan(target_epsilon=1e9)).model
    first = WeightAverage(model, DECAY)
    for weights in released[1:3]:
        model.load_state_dict(weights)
        first.update(model)
    resumed = WeightAverage(model, DECAY)
    resumed.load_state_dict(first.state_dict())
    for weights in released[3:]:
        model.load_state_dict(weights)
        resumed.update(model)
    assert all(torch.equal(resumed.state_dict()[name], value) for name, value in average.state_dict().items())


@pytest.mark.parametrize("decay", [-0.1, 1.0])
def test_a_decay_outside_zero_to_one_is_refused(regression, decay):
    with pytest.raises(ValueError, match=r"ema_decay must lie in \[0, 1\)"):
        WeightAverage(torch.nn.Linear(2, 1), decay)
