"""Pre-training on a real local Ray with two workers of half a CPU: the synthetic stage through ``vip
pretrain``, the private stage warm-started from it (its ε composed with an earlier run's on the data set, per step in
MLflow), a worker killed mid-run (replaced; the run resumes from the last checkpoint with its ledger carried on, bit
for bit for the synthetic stage, moving average included), checkpoints, the moving average's weights in evaluation
and export, damaged images, and bad input."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import math
from pathlib import Path
from typing import Iterator

import pytest
import torch

from tasks.cli import main
from vip_core.config import get_preset, validate_config, with_overrides
from vip_core.models.checkpoint import PUBLISHED_ENTRIES, CheckpointError, load_checkpoint, load_encoder
from vip_core.models.mae import build_mae
from vip_core.privacy.accounting import compute_epsilon
from vip_core.privacy.ledger import Charge

IMAGES = 96
STEPS = 4
EARLIER_RUN = Charge("an-earlier-run", 2.0, 0.25, 10, "dp-finetune")  # σ, q, steps, purpose
STAGE_FLAGS = ["--workers", "2", "--cpus-per-worker", "0.5", "--steps", str(STEPS), "--batch-size", "32",
               "--physical-batch-size", "16", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def shards(noise_shards):
    return noise_shards(IMAGES)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module; the pre-training joins it instead of starting its own."""
    from tasks.runtime.ray_session import ray_session

    with ray_session(num_workers=2, cpus_per_worker=0.5) as info:
        yield info


def _vip(*argv: str) -> tuple[int, dict | None]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, (json.loads(out.getvalue()) if out.getvalue().strip() else None)


def _synthetic_run(shards, output) -> dict:
    code, result = _vip("pretrain", "--stage", "synthetic", "--data", str(shards), "--output", str(output),
                        *STAGE_FLAGS, "--set", "synthetic.ema_decay=0.5")
    assert code == 0
    return result


@pytest.fixture(scope="module")
def synthetic(local_ray, shards, tmp_path_factory):
    return _synthetic_run(shards, tmp_path_factory.mktemp("syn") / "out")


@contextlib.contextmanager
def _rank_1_killed_after_step_3() -> Iterator[None]:
    """Runs started inside lose rank 1's process after step 3 (the last checkpoint before it is step 2), once each."""
    from tasks.stages.pretrain import FAULT_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FAULT_ENV, "1:3")
        yield


@pytest.fixture(scope="module")
def synthetic_killed(local_ray, shards, tmp_path_factory):
    """The synthetic stage again, rank 1 killed after step 3."""
    with _rank_1_killed_after_step_3():
        return _synthetic_run(shards, tmp_path_factory.mktemp("syn-killed") / "out")


def _private_config():
    # The private stage draws its fresh initialisation from another seed than the synthetic stage did, so
    # a warm start is told apart from a fresh start by the weights.
    return with_overrides(get_preset("tiny"), {
        "private.num_workers": 2, "private.cpus_per_worker": 0.5, "private.steps": STEPS, "private.batch_size": 32,
        "private.physical_batch_size": 16, "private.checkpoint_every": 2, "private.seed": 1, "private.ema_decay": 0.5,
    })


@pytest.fixture(scope="module")
def private(local_ray, shards, synthetic, tmp_path_factory):
    """The private stage, warm-started from the synthetic one, on a data set whose ledger holds an earlier run;
    rank 1 killed after step 3."""
    from tasks.stages.pretrain import ledger_book, run_pretrain
    from vip_core.train.data import measure_shards

    book = ledger_book(measure_shards(shards).fingerprint)
    with book.locked():
        book.charge(EARLIER_RUN)
    output = tmp_path_factory.mktemp("dp") / "out"
    with _rank_1_killed_after_step_3():
        return run_pretrain(_private_config(), "private", shards, output, init_checkpoint=synthetic["checkpoint"])


def _metric(run_id: str, key: str) -> list[tuple[int, float]]:
    from tasks.runtime.tracking import client

    return sorted((m.step, m.value) for m in client().get_metric_history(run_id, key))


def test_synthetic_stage_trains_on_two_workers_without_privacy(synthetic):
    assert synthetic["steps"] == STEPS and synthetic["workers"] == 2
    assert synthetic["epsilon"] is None
    assert synthetic["dataset_size"] == IMAGES and math.isclose(synthetic["sample_rate"], 32 / IMAGES)
    assert synthetic["images_per_s"] > 0 and synthetic["peak_rss_mb"] > 100
    assert synthetic["resumes"] == 0


def test_training_checkpoint_holds_model_optimizer_and_every_ranks_streams(synthetic):
    payload = load_checkpoint(synthetic["training_checkpoint"])
    assert payload["stage"] == "synthetic" and payload["step"] == STEPS
    assert {"model", "config", "state", "streams", "resumes"} <= set(payload)
    assert len(payload["streams"]) == 2
    assert all(rank["sampler"]["steps_drawn"] == STEPS for rank in payload["streams"])
    assert payload["state"]["optimizer"]["state"]  # Adam's moments, for an exact resume


def test_published_checkpoint_holds_the_allow_list_only(synthetic, private):
    for stage in (synthetic, private):
        published = load_checkpoint(stage["checkpoint"])
        training = load_checkpoint(stage["training_checkpoint"])
        assert tuple(published) == PUBLISHED_ENTRIES  # weights, config, step, ledger, ema: no streams, no loss
        assert published["step"] == STEPS
        assert all(torch.equal(published["model"][key], value) for key, value in training["model"].items())
    assert load_checkpoint(synthetic["checkpoint"])["ledger"] is None
    published = load_checkpoint(private["checkpoint"])  # trained with a moving average
    assert published["ema"].keys() == published["model"].keys()
    assert not torch.equal(published["ema"]["blocks.0.attn.qkv.weight"], published["model"]["blocks.0.attn.qkv.weight"])


def test_a_resumed_run_continues_the_weights_and_moving_average_bit_for_bit(synthetic, synthetic_killed):
    assert synthetic_killed["resumes"] == 1 and synthetic["resumes"] == 0
    uninterrupted, resumed = load_checkpoint(synthetic["checkpoint"]), load_checkpoint(synthetic_killed["checkpoint"])
    for entry in ("model", "ema"):
        assert resumed[entry].keys() == uninterrupted[entry].keys()
        assert all(torch.equal(resumed[entry][key], uninterrupted[entry][key]) for key in uninterrupted[entry])


def test_rank0_logs_loss_lr_and_throughput_every_step(synthetic):
    for key in ("train/loss", "train/lr", "train/images_per_s"):
        history = _metric(synthetic["mlflow_run_id"], key)
        assert [step for step, _ in history] == list(range(1, STEPS + 1)), key
    assert all(value > 0 for _, value in _metric(synthetic["mlflow_run_id"], "train/loss"))


def test_private_stage_spends_the_planned_epsilon_with_the_earlier_run_and_logs_it_every_step(private, shards,
                                                                                                  module_privacy_ledgers):
    from vip_core.privacy.ledger import LedgerBook
    from vip_core.train.data import measure_shards

    assert private["steps"] == STEPS and not private["stopped_by_budget"]
    alone = compute_epsilon(noise_multiplier=private["noise_multiplier"], sample_rate=private["sample_rate"],
                            steps=STEPS, delta=private["delta"], accountant=get_preset("tiny").privacy.accountant)
    book = LedgerBook.for_data_set(measure_shards(shards).fingerprint, module_privacy_ledgers)
    composed = book.epsilon(delta=private["delta"], accountant="pld")
    assert math.isclose(private["epsilon"], composed, rel_tol=1e-9) and alone < composed <= 8.0
    [ours] = [charge for charge in book.charges() if charge.run != EARLIER_RUN.run]
    assert (ours.steps, ours.purpose) == (STEPS, "pretrain-dp")
    by_step: dict[int, set[float]] = {}
    for step, value in _metric(private["mlflow_run_id"], "privacy/epsilon"):
        by_step.setdefault(step, set()).add(value)
    # Step 3 ran twice (before the kill and after the resume from step 2) and spent the same ε both times: a
    # ledger restarted at the resume would have counted only the steps after it.
    assert sorted(by_step) == list(range(1, STEPS + 1)) and all(len(values) == 1 for values in by_step.values())
    history = [value for step in sorted(by_step) for value in by_step[step]]
    assert all(a < b for a, b in zip(history, history[1:])) and math.isclose(history[-1], private["epsilon"])
    ledger = load_checkpoint(private["checkpoint"])["ledger"]
    assert ledger["steps"] == STEPS and ledger["noise_multiplier"] == private["noise_multiplier"]
    assert ledger["epsilon"] == pytest.approx(private["epsilon"])
    assert [charge["run"] for charge in ledger["composed_with"]] == [EARLIER_RUN.run]
    assert ledger["adjacency"] == private["adjacency"] == "zero-out"


def test_a_killed_worker_is_replaced_and_the_private_stage_resumes_from_the_last_checkpoint(private):
    output = Path(private["checkpoint"]).parent
    assert (output / "ray" / "fault-injected").read_text().startswith("rank 1 killed after step 3")
    assert private["resumes"] == 1 and private["steps"] == STEPS


def test_resuming_with_other_privacy_settings_is_refused(private, shards):
    from tasks.stages.pretrain import run_pretrain

    config = with_overrides(_private_config(), {"private.batch_size": 64})
    with pytest.raises(ValueError, match="resume refused: the run was planned with batch_size"):
        run_pretrain(config, "private", shards, Path(private["checkpoint"]).parent, resume=True)


def test_values_computed_from_private_data_stay_out_of_mlflow_and_the_result_by_default(private):
    assert _metric(private["mlflow_run_id"], "train/loss") == []
    assert _metric(private["mlflow_run_id"], "train/images_per_s") == []
    assert "loss" not in private and "images_per_s" not in private


def test_private_stage_starts_from_the_synthetic_weights(synthetic, private):
    synthetic_weights = load_checkpoint(synthetic["checkpoint"])["model"]
    private_weights = load_checkpoint(private["checkpoint"])["model"]
    torch.manual_seed(1)
    fresh = build_mae(get_preset("tiny").model).state_dict()
    key = "blocks.0.attn.qkv.weight"
    # A few small AdamW steps move each weight by about 1e-3; a fresh initialisation is 100 times farther.
    assert (private_weights[key] - synthetic_weights[key]).abs().max() < 5e-3
    assert (fresh[key] - synthetic_weights[key]).abs().max() > 5e-2


def test_a_finished_stage_is_not_trained_again(local_ray, shards, synthetic):
    from tasks.stages.pretrain import run_pretrain

    output = synthetic["checkpoint"].rsplit("/", 1)[0]
    config = with_overrides(get_preset("tiny"), {
        "synthetic.num_workers": 2, "synthetic.cpus_per_worker": 0.5, "synthetic.steps": STEPS,
        "synthetic.batch_size": 32, "synthetic.physical_batch_size": 16, "synthetic.checkpoint_every": 2,
        "synthetic.ema_decay": 0.5,
    })
    again = run_pretrain(config, "synthetic", shards, output)
    assert again["skipped"] is True and again["checkpoint"] == synthetic["checkpoint"]


def test_evaluation_loads_the_moving_averages_encoder_when_asked(private, tmp_path):
    from tasks.stages.eval import encoder_builders

    published, weight = load_checkpoint(private["checkpoint"]), "blocks.0.attn.qkv.weight"
    config = validate_config(published["config"])
    for choice, entry in (("ema", "ema"), ("final", "model")):
        chosen = with_overrides(config, {"evaluation.encoder_weights": choice})
        encoder = encoder_builders(chosen, config.model, private["checkpoint"])["result"]()
        assert torch.equal(encoder.state_dict()[weight], published[entry][weight])
    without = tmp_path / "checkpoint.pt"
    torch.save({**published, "ema": None}, without)
    with pytest.raises(CheckpointError, match=r"holds no EMA weights \(train with ema_decay > 0\)"):
        load_encoder(without, weights="ema")


def test_vip_export_writes_the_moving_average_when_asked_and_refuses_a_checkpoint_without_one(private, tmp_path):
    output = tmp_path / "ema.pth"
    assert main(["export", "--checkpoint", private["checkpoint"], "--format", "timm", "--output", str(output),
                 "--weights", "ema"]) == 0
    exported, published = torch.load(output, weights_only=True), load_checkpoint(private["checkpoint"])
    assert torch.equal(exported["blocks.0.attn.qkv.weight"], published["ema"]["blocks.0.attn.qkv.weight"])
    assert "moving average" in output.with_suffix(".md").read_text()
    without = tmp_path / "without.pt"
    torch.save({**published, "ema": None}, without)
    assert main(["export", "--checkpoint", str(without), "--format", "timm", "--output", str(tmp_path / "no.pth"),
                 "--weights", "ema"]) == 2
    assert not (tmp_path / "no.pth").exists()


def test_vip_eval_of_the_ema_of_a_checkpoint_without_one_is_one_line_before_any_job(private, tmp_path, capsys):
    without = tmp_path / "checkpoint.pt"
    torch.save({**load_checkpoint(private["checkpoint"]), "ema": None}, without)
    code = main(["eval", "--task", "linprobe", "--checkpoint", str(without), "--data", str(tmp_path / "images"),
                 "--output", str(tmp_path / "out"), "--set", "evaluation.encoder_weights=ema"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("vip eval: error: ") and "holds no EMA weights (train with ema_decay > 0)" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_resume_continues_a_run_for_more_steps(local_ray, shards, tmp_path):
    from tasks.stages.pretrain import run_pretrain

    def synthetic_config(steps: int):
        return with_overrides(get_preset("tiny"), {
            "synthetic.num_workers": 2, "synthetic.cpus_per_worker": 0.5, "synthetic.steps": steps,
            "synthetic.batch_size": 16, "synthetic.physical_batch_size": 16, "synthetic.checkpoint_every": 2,
        })

    first = run_pretrain(synthetic_config(2), "synthetic", shards, tmp_path / "out")
    with pytest.raises(ValueError, match="pass --resume"):
        run_pretrain(synthetic_config(4), "synthetic", shards, tmp_path / "out")
    more = run_pretrain(synthetic_config(4), "synthetic", shards, tmp_path / "out", resume=True)
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


@pytest.mark.slow
def test_logical_batch_of_4096_runs_in_microbatches_in_bounded_memory(local_ray, noise_shards, tmp_path_factory):
    """The tiny preset's DP step at B = 4,096 (microbatches of 32) needs about the memory of B = 256:
    per-sample work is bounded by the microbatch. Prints both peaks."""
    data = noise_shards(8192)
    runs = tmp_path_factory.mktemp("big")
    peaks = {}
    for batch in (256, 4096):
        code, result = _vip(
            "pretrain", "--stage", "private", "--data", str(data), "--output", str(runs / f"b{batch}"),
            "--workers", "2", "--cpus-per-worker", "0.5", "--steps", "2", "--batch-size", str(batch),
            "--physical-batch-size", "32",
        )
        assert code == 0 and result["steps"] == 2
        peaks[batch] = result["peak_rss_mb"]
    print(f"peak_rss_mb: B=256 {peaks[256]:.0f}, B=4096 {peaks[4096]:.0f}")
    assert peaks[4096] < peaks[256] + 256
