"""``make reproduce``: does DP pre-training from synthetic images give useful features? The experiment's
definition, its sizes and its findings, fixed before any run.

Arms, per seed (docs/reproduce.md): ``random-init`` (the weights both synthetic and DP-from-random start
from: ``torch.manual_seed(seed)`` then ``build_mae``), ``synthetic`` (MAE on rendered shader images, no DP),
``dp-from-synthetic`` and ``dp-from-random`` (DP-MAE at ε = 8 on private images, from the synthetic
checkpoint or from the random-init weights), optionally ``nonprivate-ceiling`` (MAE without DP on private
images, from the random-init weights) and ``raw-pixels``. Every run on private images gets its own set drawn
from the object generator (seed per arm and seed), so each DP run is (ε, δ)-DP on its own data set.

The deciding evaluation of every finding is the converged linear probe (:mod:`vip_core.eval.logistic`) on
the mean-pooled patch tokens of every encoder block, on the labelled downstream set; the verdicts come
from paired bootstrap intervals (:mod:`vip_core.eval.paired`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from vip_core.config import VipConfig, vip_pico, with_overrides
from vip_core.eval.logistic import L2_GRID
from vip_core.eval.paired import accuracy, paired_difference, per_seed, verdict

ARMS: dict[str, str] = {
    "random-init": "the initial weights of the synthetic and DP-from-random runs (no training)",
    "synthetic": "MAE on the synthetic shader images, no DP",
    "dp-from-synthetic": "DP-MAE (ε = 8) on private images, warm-started from the synthetic checkpoint",
    "dp-from-random": "DP-MAE (ε = 8) on private images, from the random-init weights",
    "nonprivate-ceiling": "MAE without DP on private images, from the random-init weights (a ceiling)",
    "raw-pixels": "the normalised pixels themselves",
}
# The arms trained on private images, each on its own set (ReproduceConfig.private_set_seed).
PRIVATE_ARMS = ("dp-from-synthetic", "dp-from-random", "nonprivate-ceiling")


@dataclass(frozen=True)
class Finding:
    """A claim ``arm - baseline > margin`` on the downstream probe's accuracy, fixed before running."""

    number: int
    claim: str
    arm: str
    baseline: str
    margin: float


FINDINGS = (
    Finding(1, "synthetic MAE beats random init", "synthetic", "random-init", 0.0),
    Finding(2, "DP warm-started from synthetic beats DP from random init at the same ε",
            "dp-from-synthetic", "dp-from-random", 0.0),
    Finding(3, "DP warm-started from synthetic is at least as good as synthetic alone (within 1 point)",
            "dp-from-synthetic", "synthetic", -0.01),
)


class ReproduceConfig(BaseModel):
    """The experiment's sizes; ``vip`` holds the model, both pre-training stages, privacy and the render."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    name: str = "reproduce"
    vip: VipConfig = Field(default_factory=vip_pico)
    seeds: tuple[int, ...] = Field((0, 1), min_length=1, description="each arm's runs: initial weights and sampling")
    private_images: int = Field(50_000, gt=0, description="images in each private run's own data set")
    downstream_train: int = Field(2_500, gt=0)
    downstream_test: int = Field(2_500, gt=0)
    nonprivate_ceiling: bool = Field(False, description="also train MAE without DP on private images")
    probe_l2_grid: tuple[float, ...] = Field(L2_GRID, min_length=1)
    probe_folds: int = Field(3, ge=2)
    bootstrap_resamples: int = Field(2000, gt=0)
    block_probes: bool = Field(True, description="also probe each encoder block alone (a diagnostic, not a finding)")
    data_seed: int = Field(1, description="the downstream set's generator seed (the synthetic stage's length was "
                                          "chosen on seed 0's set, so the default experiment scores on another)")

    @model_validator(mode="after")
    def _batch_fits_private_set(self) -> "ReproduceConfig":
        if self.vip.private.batch_size > self.private_images:
            raise ValueError(f"vip.private.batch_size {self.vip.private.batch_size} exceeds private_images "
                             f"{self.private_images}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must differ, got {self.seeds}")
        return self

    @property
    def arms(self) -> tuple[str, ...]:
        """The arms this experiment runs, in the table's order."""
        return tuple(arm for arm in ARMS if arm != "nonprivate-ceiling" or self.nonprivate_ceiling)

    def private_set_seed(self, arm: str, seed: int) -> int:
        """The object generator's seed of the private set of ``arm`` at ``seed``: a hash of the experiment's name
        and size, the arm and the seed, so that no two runs share images (the generator draws a smaller set as
        the prefix of a larger one with the same seed, and a ledger cannot tell a prefix from new data)."""
        key = f"{self.name}/{self.private_images}/{PRIVATE_ARMS.index(arm)}/{seed}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1

    def seeded(self, seed: int) -> VipConfig:
        """The pipeline config of one seed: both stages start from ``torch.manual_seed(seed)``'s weights."""
        return with_overrides(self.vip, {"synthetic.seed": seed, "private.seed": seed})

    def ceiling(self, seed: int) -> VipConfig:
        """The config of the non-private ceiling: the private stage's sizes with privacy off."""
        return with_overrides(self.seeded(seed), {"privacy.enabled": False})


def reproduce() -> ReproduceConfig:
    """``make reproduce``: two seeds, 46 minutes measured on this 2-core machine (docs/reproduce.md)."""
    return ReproduceConfig()


def reproduce_full() -> ReproduceConfig:
    """``make reproduce FULL=1``: 3,000 synthetic steps, the earlier prototype's DP stage (B = 2,048, 30 steps on
    100,000 images), three seeds and the non-private ceiling."""
    vip = with_overrides(vip_pico(), {
        "synthetic.steps": 3000, "synthetic.warmup_steps": 100, "private.batch_size": 2048, "private.steps": 30,
    })
    return ReproduceConfig(name="reproduce-full", vip=vip, seeds=(0, 1, 2), private_images=100_000,
                           downstream_train=5_000, downstream_test=5_000, nonprivate_ceiling=True)


def reproduce_smoke() -> ReproduceConfig:
    """Every arm at a size that runs in minutes: for tests, not for conclusions."""
    vip = with_overrides(vip_pico(), {
        "name": "vip-pico-smoke", "data.render.num_images": 256, "data.render.size": 32,
        "data.render.images_per_program": 32,
        "synthetic.batch_size": 64, "synthetic.physical_batch_size": 64, "synthetic.steps": 6,
        "synthetic.warmup_steps": 2, "synthetic.checkpoint_every": 3,
        "private.batch_size": 128, "private.physical_batch_size": 64, "private.steps": 3,
        "private.warmup_steps": 1, "private.checkpoint_every": 3,
    })
    return ReproduceConfig(name="reproduce-smoke", vip=vip, seeds=(0,), private_images=600, downstream_train=200,
                           downstream_test=200, nonprivate_ceiling=True, probe_l2_grid=(1e-2, 1e-1), probe_folds=2,
                           bootstrap_resamples=200)


EXPERIMENTS: dict[str, Callable[[], ReproduceConfig]] = {
    "default": reproduce, "full": reproduce_full, "smoke": reproduce_smoke,
}


def judge(correct: Mapping[str, np.ndarray], resamples: int = 2000) -> dict[str, Any]:
    """Every arm's accuracy and every finding's difference and verdict.

    Args:
        correct: per arm, whether each downstream test example was right, per seed: ``[S, N]`` booleans.
        resamples: bootstrap resamples.

    Returns:
        ``{"arms": {arm: {"mean", "low", "high", "per_seed"}}, "findings": [{"number", "claim", "arm",
        "baseline", "margin", "difference": {"mean", "low", "high"}, "verdict"}]}``; a finding whose arms
        were not run is left out.
    """
    arms = {arm: {**accuracy(values, resamples).to_dict(), "per_seed": per_seed(values)}
            for arm, values in correct.items()}
    findings = []
    for finding in FINDINGS:
        if finding.arm not in correct or finding.baseline not in correct:
            continue
        difference = paired_difference(correct[finding.arm], correct[finding.baseline], resamples)
        findings.append({**finding.__dict__, "difference": difference.to_dict(),
                         "verdict": verdict(difference, finding.margin)})
    return {"arms": arms, "findings": findings}
