"""An exponential moving average (EMA) of a model's weights, published beside them.

After every optimiser step, ``average ← d · average + (1 − d) · weights``, starting from the weights training
starts from (the seeded initialisation or the warm start: public). It reads the weights and nothing else: in a
private stage those are the released, noised weights of every step, so the average is post-processing of the
mechanism's outputs and costs no privacy. It covers the whole state dict (frozen entries too), so it loads into
the model exactly as the weights do.
"""

from __future__ import annotations

import torch
from torch import nn


class WeightAverage:
    """The moving average of ``model``'s weights with decay ``decay`` in [0, 1)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ema_decay must lie in [0, 1), got {decay}")
        self.decay = decay
        self.average = {name: value.detach().clone() for name, value in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Moves the average towards ``model``'s current weights: one call after each optimiser step."""
        weights = model.state_dict()
        torch._foreach_lerp_(list(self.average.values()), [weights[name] for name in self.average], 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average, under the model's state-dict keys."""
        return {name: value.clone() for name, value in self.average.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Continues from :meth:`state_dict` (a resume): every key of the model must be there."""
        missing = sorted(self.average.keys() - state.keys())
        if missing:
            raise ValueError(f"the checkpoint's EMA lacks {', '.join(missing[:4])}")
        with torch.no_grad():
            for name, value in self.average.items():
                value.copy_(state[name])
