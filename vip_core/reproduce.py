"""``make reproduce``: does DP pre-training from synthetic images give useful features? The experiment's
definition, its sizes and its findings, fixed before any run.

Arms, per seed (docs/reproduce.md): ``random-init`` (the weights both synthetic and DP-from-random start
from: ``torch.manual_seed(seed)`` then ``build_mae``), ``synthetic`` (MAE on rendered shader images, no DP),
``dp-from-synthetic`` and ``dp-from-random`` (DP-MAE at ε = 8 on private images, from the synthetic
checkpoint or from the random-init weights: the faithful ViP recipe), ``vip-recipe`` (DP-MAE at ε = 8 from the
synthetic checkpoint with vip's recipe, :attr:`ReproduceConfig.recipe`, at the faithful arm's training compute),
optionally ``nonprivate-ceiling`` (MAE without DP on private images, from the random-init weights) and
``raw-pixels``. Every run on private images gets its own set drawn from the object generator (seed per arm and
seed), so each DP run is (ε, δ)-DP on its own data set.

The arms' encoders are trained once and probed on every downstream task of the experiment's split
(:data:`SPLITS`): the development tasks and seeds choose the recipe, the held-out ones score it. The deciding
evaluation of every finding is the converged linear probe (:mod:`vip_core.eval.logistic`) on the mean-pooled
patch tokens of every encoder block, on each task's labelled set; the verdicts come from paired bootstrap
intervals (:mod:`vip_core.eval.paired`), per task.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pydantic import ValidationError

from vip_core.config import VipConfig, parse_setting, vip_pico, with_overrides
from vip_core.eval.logistic import L2_GRID
from vip_core.eval.paired import accuracy, paired_difference, per_seed, verdict
from vip_core.models.flops import stage_flops

ARMS: dict[str, str] = {
    "random-init": "the initial weights of the synthetic and DP-from-random runs (no training)",
    "synthetic": "MAE on the synthetic shader images, no DP",
    "dp-from-synthetic": "DP-MAE (ε = 8) on private images, warm-started from the synthetic checkpoint",
    "vip-recipe": "DP-MAE (ε = 8) on private images, from the synthetic checkpoint, with vip's recipe at the same "
                  "training compute",
    "dp-from-random": "DP-MAE (ε = 8) on private images, from the random-init weights",
    "nonprivate-ceiling": "MAE without DP on private images, from the random-init weights (a ceiling)",
    "raw-pixels": "the normalised pixels themselves",
}
# The arms trained on private images, each on its own set (ReproduceConfig.private_set_seed; appended, never
# reordered: an arm's index is part of its set's seed).
PRIVATE_ARMS = ("dp-from-synthetic", "dp-from-random", "nonprivate-ceiling", "vip-recipe")
WARM_STARTED = ("dp-from-synthetic", "vip-recipe")  # the private arms that start from the synthetic checkpoint


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
    Finding(4, "vip's recipe beats a faithful ViP recipe at the same ε and the same training compute",
            "vip-recipe", "dp-from-synthetic", 0.0),
    Finding(5, "DP from synthetic beats raw pixels", "dp-from-synthetic", "raw-pixels", 0.0),
)

# vip's recipe: dotted overrides of the DP stage (and of how its encoder is evaluated) applied to the
# ``vip-recipe`` arm only, chosen on the development split (docs/reproduce.md, "How vip's recipe was chosen"):
# half the batch for twice the steps, the same FLOPs, warm-up scaled with them. Values are for the default
# experiment's sizes.
VIP_RECIPE: dict[str, Any] = {"private.batch_size": 512, "private.steps": 32, "private.warmup_steps": 20}
# What a recipe may change: the DP stage's training, its clipping bound and the encoder's evaluation; the ε, δ
# and the model stay the faithful arm's (same ε; the warm start loads the synthetic checkpoint).
RECIPE_FIELDS = ("private.", "privacy.max_grad_norm", "evaluation.")
# How far vip-recipe's DP-stage FLOPs may lie from dp-from-synthetic's (B not divisible by a multiplicity K
# rounds B / K).
COMPUTE_TOLERANCE = 0.02


@dataclass(frozen=True)
class DownstreamTask:
    """A labelled downstream task: a generator (:data:`vip_core.data.downstream.TASK_KINDS`) and its seed."""

    kind: str
    data_seed: int

    @property
    def name(self) -> str:
        return f"{self.kind}-seed{self.data_seed}"

    def describe(self) -> str:
        return f"{self.kind} (data seed {self.data_seed})"


# The development split chooses the recipe (with DEVELOPMENT_SEEDS as training seeds); the held-out split scores
# it on other data seeds of the same kinds, on a kind never used in choosing (counting) and with other training
# seeds. Shapes seed 0 also chose the synthetic stage's length.
DEVELOPMENT_SEEDS = (100, 101)
SPLITS: dict[str, tuple[DownstreamTask, ...]] = {
    "development": (DownstreamTask("shapes", 0), DownstreamTask("textures", 0)),
    "held-out": (DownstreamTask("shapes", 1), DownstreamTask("textures", 1), DownstreamTask("counting", 1)),
}


class ReproduceConfig(BaseModel):
    """The experiment's sizes; ``vip`` holds the model, both pre-training stages, privacy and the render."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    name: str = "reproduce"
    vip: VipConfig = Field(default_factory=vip_pico)
    seeds: tuple[int, ...] = Field((0, 1), min_length=1, description="each arm's runs: initial weights and sampling")
    private_images: int = Field(50_000, gt=0, description="images in each private run's own data set")
    downstream_train: int = Field(2_500, gt=0, description="labelled training images of each downstream task")
    downstream_test: int = Field(2_500, gt=0, description="test images of each downstream task")
    split: Literal["held-out", "development"] = Field(
        "held-out", description="the downstream tasks and training seeds: held-out scores, development chooses")
    recipe: dict[str, Any] = Field(default_factory=dict, description="the vip-recipe arm's dotted overrides of the "
                                   "DP stage (private.*, privacy.max_grad_norm, evaluation.*)")
    nonprivate_ceiling: bool = Field(False, description="also train MAE without DP on private images")
    probe_l2_grid: tuple[float, ...] = Field(L2_GRID, min_length=1)
    probe_folds: int = Field(3, ge=2)
    bootstrap_resamples: int = Field(2000, gt=0)
    block_probes: bool = Field(True, description="also probe each encoder block alone (a diagnostic, not a finding)")

    @model_validator(mode="after")
    def _batch_fits_private_set(self) -> "ReproduceConfig":
        if self.vip.private.batch_size > self.private_images:
            raise ValueError(f"vip.private.batch_size {self.vip.private.batch_size} exceeds private_images "
                             f"{self.private_images}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must differ, got {self.seeds}")
        return self

    @model_validator(mode="after")
    def _seeds_in_split(self) -> "ReproduceConfig":
        development = set(self.seeds) & set(DEVELOPMENT_SEEDS)
        if self.split == "held-out" and development:
            raise ValueError(f"seeds {sorted(development)} are development seeds: the held-out split scores on others")
        if self.split == "development" and not development == set(self.seeds):
            raise ValueError(f"split development trains on seeds from {DEVELOPMENT_SEEDS} only, got {self.seeds}")
        return self

    @model_validator(mode="after")
    def _recipe_at_the_same_epsilon_and_compute(self) -> "ReproduceConfig":
        outside = [key for key in self.recipe if not key.startswith(RECIPE_FIELDS) or key == "private.seed"]
        if outside:
            raise ValueError(f"recipe: {outside[0]} is not a field a recipe may set ({', '.join(RECIPE_FIELDS)} but "
                             "the seed: the same ε, model, seed and synthetic checkpoint as the faithful arm)")
        recipe, faithful = self.arm_config("vip-recipe", 0), self.seeded(0)
        ratio = stage_flops(recipe.model, recipe.private) / stage_flops(faithful.model, faithful.private)
        if abs(ratio - 1) > COMPUTE_TOLERANCE:
            raise ValueError(f"recipe: its DP stage costs {ratio:.3f} x the faithful arm's FLOPs (tolerance "
                             f"{COMPUTE_TOLERANCE:.0%}); with an augmentation multiplicity K, divide "
                             "private.batch_size (or private.steps) by K")
        return self

    @property
    def tasks(self) -> tuple[DownstreamTask, ...]:
        """The downstream tasks every arm is probed on, in the report's order."""
        return SPLITS[self.split]

    @property
    def arms(self) -> tuple[str, ...]:
        """The arms this experiment runs, in the table's order."""
        return tuple(arm for arm in ARMS if arm != "nonprivate-ceiling" or self.nonprivate_ceiling)

    def private_set_seed(self, arm: str, seed: int) -> int:
        """The object generator's seed of the private set of ``arm`` at ``seed``: a hash of the experiment's name
        and size, the arm and the seed (and for ``vip-recipe``, the recipe), so that no two runs share images (the
        generator draws a smaller set as the prefix of a larger one with the same seed, and a ledger cannot tell
        a prefix from new data); trying recipes one after another trains each on a set of its own."""
        key = f"{self.name}/{self.private_images}/{PRIVATE_ARMS.index(arm)}/{seed}"
        if arm == "vip-recipe" and self.recipe:  # each candidate recipe is a release of its own set, not a retry
            key += "/" + json.dumps(self.recipe, sort_keys=True)
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1

    def seeded(self, seed: int) -> VipConfig:
        """The pipeline config of one seed: both stages start from ``torch.manual_seed(seed)``'s weights."""
        return with_overrides(self.vip, {"synthetic.seed": seed, "private.seed": seed})

    def ceiling(self, seed: int) -> VipConfig:
        """The config of the non-private ceiling: the private stage's sizes with privacy off."""
        return with_overrides(self.seeded(seed), {"privacy.enabled": False})

    def arm_config(self, arm: str, seed: int) -> VipConfig:
        """The pipeline config an arm of one seed trains (and is evaluated) with."""
        if arm == "nonprivate-ceiling":
            return self.ceiling(seed)
        if arm == "vip-recipe":
            return with_overrides(self.seeded(seed), self.recipe)
        return self.seeded(seed)

    def compute(self) -> dict[str, int]:
        """Each encoder arm's training compute in FLOPs (forward and backward per image x images seen, every
        stage it trained, :mod:`vip_core.models.flops`); random init and raw pixels train nothing."""
        synthetic = stage_flops(self.vip.model, self.vip.synthetic)
        flops = {"random-init": 0, "synthetic": synthetic}
        for arm in PRIVATE_ARMS:
            if arm in self.arms:
                config = self.arm_config(arm, 0)
                flops[arm] = stage_flops(config.model, config.private) + (synthetic if arm in WARM_STARTED else 0)
        return flops

    def describe_split(self) -> str:
        """Which tasks and seeds chose the recipe and which score it, for the report."""
        chosen = ", ".join(task.describe() for task in SPLITS["development"])
        scored = ", ".join(task.describe() for task in SPLITS["held-out"])
        here = "development: choosing the recipe" if self.split == "development" else "held-out: scoring"
        return (f"Split {here}. Recipe chosen on: {chosen}; training seeds "
                f"{', '.join(map(str, DEVELOPMENT_SEEDS))}. Scored on: {scored}; training seeds other than those "
                f"(this run: {', '.join(map(str, self.seeds))}).")


def reproduce() -> ReproduceConfig:
    """``make reproduce``: two seeds, the held-out split's three tasks, vip's recipe beside the faithful one;
    20 minutes on this 2-core machine (docs/reproduce.md, Results). The per-block probes are left out: on three
    tasks they would cost about 30 minutes more."""
    return ReproduceConfig(recipe=VIP_RECIPE, block_probes=False)


def reproduce_development() -> ReproduceConfig:
    """The default experiment's sizes and recipe on the development split: for choosing the recipe."""
    return ReproduceConfig(name="reproduce-development", split="development", seeds=DEVELOPMENT_SEEDS,
                           recipe=VIP_RECIPE, block_probes=False)


def reproduce_full() -> ReproduceConfig:
    """``make reproduce FULL=1``: 3,000 synthetic steps, the earlier prototype's DP stage (B = 2,048, 30 steps on
    100,000 images), three seeds, the non-private ceiling and the per-block probes; the faithful recipe in both DP
    arms (:data:`VIP_RECIPE`'s values are for the default's batch size)."""
    vip = with_overrides(vip_pico(), {
        "synthetic.steps": 3000, "synthetic.warmup_steps": 100, "private.batch_size": 2048, "private.steps": 30,
    })
    return ReproduceConfig(name="reproduce-full", vip=vip, seeds=(0, 1, 2), private_images=100_000,
                           downstream_train=5_000, downstream_test=5_000, nonprivate_ceiling=True)


def reproduce_smoke() -> ReproduceConfig:
    """Every arm at a size that runs in minutes, the per-block probes off (the stage tests cover them): for tests,
    not for conclusions."""
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
                           bootstrap_resamples=200, block_probes=False)


def with_recipe(experiment: ReproduceConfig, settings: list[str]) -> ReproduceConfig:
    """``experiment`` with its recipe replaced by ``FIELD=VALUE`` settings (values read as YAML).

    Raises:
        ValueError: one line naming the malformed setting, or why the experiment refuses the recipe.
    """
    recipe = dict(parse_setting(text) for text in settings)
    try:
        return ReproduceConfig.model_validate({**experiment.model_dump(), "recipe": recipe})
    except ValidationError as error:
        raise ValueError(error.errors()[0]["msg"].removeprefix("Value error, ")) from None


EXPERIMENTS: dict[str, Callable[[], ReproduceConfig]] = {
    "default": reproduce, "development": reproduce_development, "full": reproduce_full, "smoke": reproduce_smoke,
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
