"""Poisson sampling: each logical step includes every example independently with probability q.

The accountant must be fed this same q (docs/privacy.md, rule 1): the sampler and the ledger of a run are
built from one :class:`~vip_core.privacy.plan.PrivacyPlan` by :class:`~vip_core.train.step.PrivateStep`.
The draw compares 64-bit integers (:meth:`~vip_core.privacy.randomness.RandomStream.poisson_indices`), so
the realised rate is q to within 2^-64 and never above it. The realised batch size is random (possibly 0);
the engine divides by the expected size q·N instead. With several workers, each one samples its own block
of the data from its own independent stream (rule 3).
"""

from __future__ import annotations

from typing import Any

import torch

from vip_core.privacy.randomness import RandomStream


class PoissonSampler:
    """Index tensors of Poisson-sampled logical batches, one per step, resumable.

    Args:
        dataset_size: N, the number of examples to sample from (a worker's block of the data set).
        sample_rate: q in (0, 1], the inclusion probability of each example at each step.
        stream: the random stream of the draws.
    """

    def __init__(self, dataset_size: int, sample_rate: float, stream: RandomStream) -> None:
        if dataset_size <= 0:
            raise ValueError(f"dataset_size must be > 0, got {dataset_size}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}")
        self.dataset_size = int(dataset_size)
        self.sample_rate = float(sample_rate)
        self.stream = stream
        self.steps_drawn = 0

    def sample(self) -> torch.Tensor:
        """The indices ``[k]`` (sorted, int64) of the next logical batch; k ~ Binomial(N, q) may be 0."""
        self.steps_drawn += 1
        return self.stream.poisson_indices(self.dataset_size, self.sample_rate)  # [k]

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: the settings, the steps drawn so far and the stream's state."""
        return {"dataset_size": self.dataset_size, "sample_rate": self.sample_rate, "steps_drawn": self.steps_drawn,
                "stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues the draws saved by :meth:`state_dict`; the settings must match."""
        saved = (state["dataset_size"], state["sample_rate"])
        if saved != (self.dataset_size, self.sample_rate):
            raise ValueError(
                f"sampler state is for dataset_size={saved[0]}, sample_rate={saved[1]}, "
                f"not {self.dataset_size}, {self.sample_rate}"
            )
        self.stream.load_state_dict(state["stream"])
        self.steps_drawn = int(state["steps_drawn"])
