"""Poisson sampling: each logical step includes every example independently with probability q.

The accountant must be fed this same q (DESIGN rule 1): build the sampler and the
:class:`~vip_core.privacy.ledger.PrivacyLedger` from one :class:`~vip_core.privacy.plan.PrivacyPlan`.
The realised batch size is random (possibly 0); the engine divides by the expected size q·N instead.
With several workers, each one draws from its own independent generator (DESIGN rule 3).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


class PoissonSampler:
    """Index tensors of Poisson-sampled logical batches, one per step, resumable.

    Args:
        dataset_size: N, the number of examples to sample from.
        sample_rate: q in (0, 1], the inclusion probability of each example at each step.
        generator: the source of randomness (CPU); a fresh unseeded one when None.
    """

    def __init__(self, dataset_size: int, sample_rate: float, generator: torch.Generator | None = None) -> None:
        if dataset_size <= 0:
            raise ValueError(f"dataset_size must be > 0, got {dataset_size}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}")
        self.dataset_size = int(dataset_size)
        self.sample_rate = float(sample_rate)
        if generator is None:
            generator = torch.Generator()
            generator.seed()
        self.generator = generator
        self.steps_drawn = 0

    @property
    def expected_batch_size(self) -> float:
        """q·N, the public divisor of the summed gradient."""
        return self.sample_rate * self.dataset_size

    def sample(self) -> torch.Tensor:
        """The indices ``[k]`` (sorted, int64) of the next logical batch; k ~ Binomial(N, q) may be 0."""
        draws = torch.rand(self.dataset_size, generator=self.generator, device=self.generator.device)  # [N]
        self.steps_drawn += 1
        return torch.nonzero(draws < self.sample_rate).squeeze(1).cpu()  # [k]

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.sample()

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: the settings, the steps drawn so far and the generator state."""
        return {
            "dataset_size": self.dataset_size,
            "sample_rate": self.sample_rate,
            "steps_drawn": self.steps_drawn,
            "generator_state": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues the stream saved by :meth:`state_dict`; the settings must match."""
        saved = (state["dataset_size"], state["sample_rate"])
        if saved != (self.dataset_size, self.sample_rate):
            raise ValueError(
                f"sampler state is for dataset_size={saved[0]}, sample_rate={saved[1]}, "
                f"not {self.dataset_size}, {self.sample_rate}"
            )
        self.generator.set_state(state["generator_state"])
        self.steps_drawn = int(state["steps_drawn"])


def physical_batches(indices: torch.Tensor, physical_batch_size: int) -> list[torch.Tensor]:
    """Splits a logical batch's indices into consecutive chunks of at most ``physical_batch_size``."""
    if physical_batch_size <= 0:
        raise ValueError(f"physical_batch_size must be > 0, got {physical_batch_size}")
    return [indices[start : start + physical_batch_size] for start in range(0, len(indices), physical_batch_size)]
