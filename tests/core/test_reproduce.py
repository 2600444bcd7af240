import numpy as np
import pytest

from vip_core.config import ConfigError
from vip_core.reproduce import EXPERIMENTS, FINDINGS, PRIVATE_ARMS, ReproduceConfig, judge, reproduce


def test_the_findings_are_fixed_with_their_margins():
    assert [(f.arm, f.baseline, f.margin) for f in FINDINGS] == [
        ("synthetic", "random-init", 0.0), ("dp-from-synthetic", "dp-from-random", 0.0),
        ("dp-from-synthetic", "synthetic", -0.01)]


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
