import numpy as np
import pytest

from vip_core.config import ConfigError
from vip_core.reproduce import (DEVELOPMENT_SEEDS, EXPERIMENTS, FINDINGS, PRIVATE_ARMS, SPLITS, ReproduceConfig,
                                judge, reproduce, reproduce_development, with_recipe)


def test_the_findings_are_fixed_with_their_margins():
    assert [(f.arm, f.baseline, f.margin) for f in FINDINGS] == [
        ("synthetic", "random-init", 0.0), ("dp-from-synthetic", "dp-from-random", 0.0),
        ("dp-from-synthetic", "synthetic", -0.01), ("vip-recipe", "dp-from-synthetic", 0.0),
        ("dp-from-synthetic", "raw-pixels", 0.0)]


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_every_experiment_builds_and_round_trips(name):
    experiment = EXPERIMENTS[name]()
    assert ReproduceConfig.model_validate(experiment.model_dump(mode="json")) == experiment


def test_every_private_run_has_its_own_data_set_and_both_stages_share_the_seed():
    experiments = [factory() for factory in EXPERIMENTS.values()]
    seeds = {e.private_set_seed(arm, seed) for e in experiments for arm in PRIVATE_ARMS for seed in range(1001)}
    assert len(seeds) == len(experiments) * len(PRIVATE_ARMS) * 1001  # seed 1000 of one arm is no other arm's 0
    experiment = reproduce()
    config = experiment.seeded(7)
    assert config.synthetic.seed == config.private.seed == 7 and config.privacy.enabled
    assert not experiment.ceiling(7).privacy.enabled


def test_each_candidate_recipe_trains_on_a_private_set_of_its_own_and_the_other_arms_keep_theirs():
    faithful = reproduce_development()
    candidates = [with_recipe(faithful, settings) for settings in (["private.lr=0.002"], ["private.lr=0.003"])]
    recipe_sets = {e.private_set_seed("vip-recipe", seed) for e in (faithful, *candidates) for seed in e.seeds}
    assert len(recipe_sets) == 3 * len(faithful.seeds)
    for arm in ("dp-from-synthetic", "dp-from-random"):
        assert {e.private_set_seed(arm, 100) for e in (faithful, *candidates)} == {faithful.private_set_seed(arm, 100)}


def test_a_batch_larger_than_the_private_set_is_refused():
    with pytest.raises(ValueError, match="exceeds private_images"):
        ReproduceConfig(private_images=100)
    with pytest.raises((ValueError, ConfigError)):
        ReproduceConfig(seeds=(1, 1))


def test_judge_gives_every_arm_and_each_finding_a_verdict():
    rng = np.random.default_rng(0)
    base = rng.random((2, 1000)) < 0.3
    correct = {"random-init": base, "synthetic": base | (rng.random((2, 1000)) < 0.3),
               "dp-from-synthetic": base, "dp-from-random": base}
    judged = judge(correct, resamples=300)
    assert set(judged["arms"]) == set(correct)
    verdicts = {f["number"]: f["verdict"] for f in judged["findings"]}
    assert verdicts == {1: "reproduced", 2: "inconclusive", 3: "not reproduced"}


def test_the_development_and_held_out_splits_share_no_task_seed_and_no_training_seed():
    development, held_out = ({(t.kind, t.data_seed) for t in SPLITS[name]} for name in ("development", "held-out"))
    assert not development & held_out
    assert {kind for kind, _ in held_out} - {kind for kind, _ in development} == {"counting"}  # a kind never chosen on
    assert len({kind for kind, _ in held_out}) >= 3
    assert not set(reproduce().seeds) & set(reproduce_development().seeds)
    assert reproduce_development().tasks == SPLITS["development"] and reproduce().tasks == SPLITS["held-out"]
    with pytest.raises(ValueError, match=r"seeds \[100\] are development seeds"):
        ReproduceConfig(seeds=(0, DEVELOPMENT_SEEDS[0]))
    with pytest.raises(ValueError, match="split development trains on seeds from"):
        ReproduceConfig(split="development", seeds=(0,))
    assert "Recipe chosen on: shapes (data seed 0), textures (data seed 0); training seeds 100, 101. Scored on: " \
           "shapes (data seed 1), textures (data seed 1), counting (data seed 1)" in reproduce().describe_split()


def test_the_recipe_arm_trains_with_its_overrides_at_the_faithful_arms_compute():
    experiment = ReproduceConfig(recipe={"private.lr": 2e-3, "private.batch_size": 1010, "privacy.max_grad_norm": 0.5})
    recipe, faithful = experiment.arm_config("vip-recipe", 1), experiment.arm_config("dp-from-synthetic", 1)
    assert (recipe.private.lr, recipe.private.batch_size, recipe.privacy.max_grad_norm) == (2e-3, 1010, 0.5)
    assert recipe.private.seed == faithful.private.seed == 1 and recipe.privacy.target_epsilon == 8.0
    compute = experiment.compute()
    assert compute["vip-recipe"] < compute["dp-from-synthetic"] and compute["vip-recipe"] / compute["dp-from-synthetic"] > 0.99
    assert compute["dp-from-synthetic"] == compute["synthetic"] + compute["dp-from-random"]  # warm start: both stages


@pytest.mark.parametrize("recipe, message", [
    ({"private.steps": 32}, r"recipe: its DP stage costs 2.000 x the faithful arm's FLOPs \(tolerance 2%\); with an "
                            r"augmentation multiplicity K, divide private.batch_size \(or private.steps\) by K"),
    ({"private.batch_size": 900}, "costs 0.879 x"),
    ({"privacy.target_epsilon": 16.0}, "recipe: privacy.target_epsilon is not a field a recipe may set"),
    ({"synthetic.steps": 10}, "recipe: synthetic.steps is not a field a recipe may set"),
    ({"private.seed": 3}, "recipe: private.seed is not a field a recipe may set"),
    ({"private.no_such_lever": 1}, "no_such_lever"),
])
def test_a_recipe_at_another_compute_or_epsilon_or_an_unknown_field_is_refused(recipe, message):
    with pytest.raises(ValueError, match=message):
        ReproduceConfig(recipe=recipe)


def test_findings_4_and_5_from_a_fabricated_table():
    rng = np.random.default_rng(1)
    dp = rng.random((2, 2000)) < 0.4  # [S, N]
    better = dp | (rng.random((2, 2000)) < 0.2)  # right wherever dp is, and on a fifth of the rest
    pixels = np.repeat(rng.random((1, 2000)) < 0.4, 2, axis=0)  # one row, the same for every seed
    tasks = {"recipe helps, pixels as good": {"vip-recipe": better, "dp-from-synthetic": dp, "raw-pixels": dp},
             "recipe hurts, pixels worse": {"vip-recipe": dp & (rng.random((2, 2000)) < 0.6), "dp-from-synthetic": better,
                                            "raw-pixels": pixels & (rng.random((2, 2000)) < 0.5)}}
    verdicts = {name: {f["number"]: f["verdict"] for f in judge(correct, resamples=300)["findings"]}
                for name, correct in tasks.items()}
    assert verdicts == {"recipe helps, pixels as good": {4: "reproduced", 5: "inconclusive"},
                        "recipe hurts, pixels worse": {4: "not reproduced", 5: "reproduced"}}


def test_a_recipe_given_as_settings_replaces_the_experiments_or_is_refused_in_one_line():
    experiment = with_recipe(reproduce_development(), ["private.lr=0.002", "privacy.max_grad_norm=0.2"])
    assert experiment.recipe == {"private.lr": 2e-3, "privacy.max_grad_norm": 0.2}
    assert experiment.split == "development" and experiment.arm_config("vip-recipe", 100).private.lr == 2e-3
    with pytest.raises(ValueError, match=r"^recipe: its DP stage costs 0.500 x the faithful arm's FLOPs [^\n]*$"):
        with_recipe(reproduce(), ["private.batch_size=512"])
    with pytest.raises(ValueError, match="malformed setting 'private.lr'"):
        with_recipe(reproduce(), ["private.lr"])
