"""Fault tolerance of DP pre-training: a worker process killed mid-run is replaced, training resumes from
the last checkpoint and ends with the step count and the ε of the plan, as an uninterrupted run does (the ledger
is carried on, not restarted). A resumed run must keep its privacy plan."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from vip_core.config import get_preset, with_overrides
from vip_core.models.checkpoint import load_checkpoint
from vip_core.privacy.accounting import compute_epsilon

STEPS = 6
KILLED_RANK, KILLED_AFTER = 1, 3  # the last checkpoint before the kill is step 2


def _config(**extra):
    return with_overrides(get_preset("tiny"), {
        "private.num_workers": 2, "private.cpus_per_worker": 0.5, "private.steps": STEPS, "private.batch_size": 16,
        "private.physical_batch_size": 16, "private.checkpoint_every": 2, **extra,
    })


@pytest.fixture(scope="module")
def shards(noise_shards):
    return noise_shards(64)


@pytest.fixture(scope="module")
def local_ray():
    from tasks.runtime.ray_session import ray_session

    with ray_session(num_workers=2, cpus_per_worker=0.5) as info:
        yield info


@pytest.fixture(scope="module")
def killed(local_ray, shards, tmp_path_factory):
    from tasks.stages.pretrain import FAULT_ENV, run_pretrain

    output = tmp_path_factory.mktemp("killed") / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FAULT_ENV, f"{KILLED_RANK}:{KILLED_AFTER}")
        return output, run_pretrain(_config(), "private", shards, output)


def test_killed_worker_is_replaced_and_training_resumes_from_the_last_checkpoint(killed):
    output, result = killed
    assert (output / "ray" / "fault-injected").read_text().startswith(f"rank {KILLED_RANK} killed after step 3")
    assert result["resumes"] == 1
    assert result["steps"] == STEPS
    assert load_checkpoint(result["checkpoint"])["ledger"]["steps"] == STEPS


def test_final_steps_and_epsilon_are_those_of_the_plan(killed):
    _, interrupted = killed
    planned = compute_epsilon(noise_multiplier=interrupted["noise_multiplier"], sample_rate=interrupted["sample_rate"],
                              steps=STEPS, delta=interrupted["delta"], accountant=get_preset("tiny").privacy.accountant)
    # A ledger restarted at the resume would have counted only the steps after it.
    assert interrupted["steps"] == STEPS and math.isclose(interrupted["epsilon"], planned, rel_tol=1e-9)


def test_epsilon_history_continues_across_the_restart(killed):
    from tasks.runtime.tracking import client

    _, result = killed
    history = client().get_metric_history(result["mlflow_run_id"], "privacy/epsilon")
    by_step: dict[int, set[float]] = {}
    for metric in history:
        by_step.setdefault(metric.step, set()).add(metric.value)
    assert sorted(by_step) == list(range(1, STEPS + 1))
    # Step 3 ran twice (before the kill and after the resume from step 2) and spent the same ε both times.
    assert all(len(values) == 1 for values in by_step.values())


def test_resuming_with_other_privacy_settings_is_refused(killed, shards):
    from tasks.stages.pretrain import run_pretrain

    output, _ = killed
    with pytest.raises(ValueError, match="resume refused: the run was planned with batch_size"):
        run_pretrain(_config(**{"private.batch_size": 32}), "private", shards, output, resume=True)


@pytest.mark.slow
def test_resume_continues_a_run_for_more_steps(local_ray, shards, tmp_path):
    from tasks.stages.pretrain import run_pretrain

    def synthetic(steps: int):
        return with_overrides(get_preset("tiny"), {
            "synthetic.num_workers": 2, "synthetic.cpus_per_worker": 0.5, "synthetic.steps": steps,
            "synthetic.batch_size": 16, "synthetic.physical_batch_size": 16, "synthetic.checkpoint_every": 2,
        })

    first = run_pretrain(synthetic(2), "synthetic", shards, tmp_path / "out")
    with pytest.raises(ValueError, match="pass --resume"):
        run_pretrain(synthetic(4), "synthetic", shards, tmp_path / "out")
    more = run_pretrain(synthetic(4), "synthetic", shards, tmp_path / "out", resume=True)
    assert (first["steps"], more["steps"], more["resumes"]) == (2, 4, 1)


def test_a_damaged_image_is_left_out_of_the_steps_inputs_with_its_masks(damaged_shards):
    from tasks.stages.pretrain import build_worker_run
    from tests.core.privacy.test_dp_rules import worker_loop_config

    folder, damaged = damaged_shards
    config = with_overrides(get_preset("tiny"), {"private.batch_size": 64, "private.augmentation": "rrc_flip"})
    run = build_worker_run(worker_loop_config(config, folder), 0, 1)
    try:
        local = run.pipeline.sample()  # q = 1: all 64 images
        stream = copy.deepcopy(run.step.streams.sample)
        pixels, noise, crops = run.batch(local, run.step.streams.sample)
    finally:
        run.pipeline.close()
    usable = [i for i in range(64) if f"{i:05d}.jpg" not in damaged]
    assert len(local) == 64 and run.damaged == len(damaged) == 4
    assert len(pixels) == len(noise) == len(crops) == 60 and pixels.flatten(1).amax(dim=1).gt(0).all()
    assert torch.equal(noise, stream.uniform((64, run.model.num_patches))[usable])  # drawn for all, rows kept


def test_damaged_images_are_skipped_and_counted_and_the_run_finishes(local_ray, damaged_shards, tmp_path, caplog):
    from tasks.stages.pretrain import PRIVATE_STATISTICS_WARNING, run_pretrain

    folder, damaged = damaged_shards  # 64 images, 4 of them damaged
    config = with_overrides(get_preset("tiny"), {
        "private.num_workers": 2, "private.cpus_per_worker": 0.5, "private.steps": 2, "private.batch_size": 64,
        "private.physical_batch_size": 32, "private.checkpoint_every": 2, "privacy.log_private_statistics": True,
    })
    with caplog.at_level(logging.WARNING, logger="tasks.stages.pretrain"):
        result = run_pretrain(config, "private", folder, tmp_path / "out")
    # The count is reported only where private statistics may leave the run, and turning that on says so once.
    assert [record.getMessage() for record in caplog.records].count(PRIVATE_STATISTICS_WARNING) == 1
    assert result["steps"] == 2 and result["dataset_size"] == 64 and result["sample_rate"] == 1.0
    assert result["damaged_images_skipped"] == 2 * len(damaged)  # q = 1: every image in both steps
    assert math.isfinite(result["loss"])
