"""The reproduce experiment's evaluation stage at a reduced size: every encoder arm probed on all blocks and, as a
diagnostic, on each block alone, on every downstream task; the report's table shows the five findings per task."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.stages.reproduce import claim_workdir, evaluate_seed, write_downstream_set, write_report
from vip_core.config import with_overrides
from vip_core.models import build_mae, save_checkpoint
from vip_core.data.downstream import TASK_KINDS
from vip_core.reproduce import FINDINGS, DownstreamTask, ReproduceConfig, reproduce_smoke

TRAINED_ARMS = ("synthetic", "dp-from-synthetic", "vip-recipe", "dp-from-random")


# A 2-block 32-wide encoder at 16 px and one strong penalty: the probes see 64 pooled features (768 raw pixels)
# and fit three times each, so that every arm on every task is probed in a minute or two on a loaded 2-core machine.
TINY_MODEL = {"model.img_size": 16, "model.embed_dim": 32, "model.depth": 2, "model.num_heads": 2,
              "model.decoder_embed_dim": 32, "model.decoder_depth": 1, "model.decoder_num_heads": 2}


def _tiny(**update) -> ReproduceConfig:
    experiment = reproduce_smoke()
    return experiment.model_copy(update={"vip": with_overrides(experiment.vip, TINY_MODEL), "probe_l2_grid": (1.0,),
                                         **update})


@pytest.fixture(scope="module")
def downstream(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reproduce") / "downstream"
    write_downstream_set(folder, DownstreamTask("shapes", 0), train=60, test=60, size=16)
    return folder


def _checkpoints(experiment, folder) -> dict[str, str]:
    torch.manual_seed(7)  # one trained-looking encoder for every trained arm: other weights than random-init's
    checkpoint = save_checkpoint(folder, model=build_mae(experiment.vip.model), config=experiment.vip,
                                 stage="private", step=0)
    return {arm: str(checkpoint) for arm in TRAINED_ARMS}


def test_each_encoder_arm_is_also_probed_block_by_block_and_the_table_shows_it(downstream, tmp_path):
    experiment = _tiny(nonprivate_ceiling=False, block_probes=True)
    checkpoints = _checkpoints(experiment, tmp_path / "run")
    encoders = evaluate_seed(experiment, 0, checkpoints, downstream, tmp_path / "seed0")
    pixels = evaluate_seed(experiment, None, {}, downstream, tmp_path / "pixels")

    depth = experiment.vip.model.depth
    for arm, result in encoders["arms"].items():
        assert len(result["blocks_top1"]) == depth and all(0 <= v <= 1 for v in result["blocks_top1"]), arm
    assert encoders["arms"]["random-init"]["blocks_top1"] != encoders["arms"]["synthetic"]["blocks_top1"]
    assert "blocks_top1" not in pixels["arms"]["raw-pixels"]

    evaluations = {task.name: [encoders, pixels] for task in experiment.tasks}  # one set's results stand for each task
    report = write_report(experiment, evaluations, [], tmp_path / "report")
    shapes = report["tasks"][experiment.tasks[0].name]
    assert shapes["blocks"]["random-init"] == encoders["arms"]["random-init"]["blocks_top1"]  # one seed: its values
    assert "Diagnostic, decided by no finding" in report["table"]
    row = next(line for line in report["table"].splitlines() if line.startswith("| random-init |") and
               line.count("|") == depth + 3)
    assert f"{encoders['arms']['random-init']['blocks_top1'][0]:.3f}" in row


def test_without_block_probes_the_table_has_no_diagnostic(downstream, tmp_path):
    experiment = _tiny(nonprivate_ceiling=False, block_probes=False)
    result = evaluate_seed(experiment, 0, _checkpoints(experiment, tmp_path / "run"), downstream, tmp_path / "seed0")
    assert all("blocks_top1" not in arm for arm in result["arms"].values())


def test_a_workdir_holds_one_experiment_and_refuses_another_with_the_setting_that_differs(tmp_path):
    experiment = reproduce_smoke()
    root = tmp_path / "reproduce"
    claim_workdir(root, experiment)
    claim_workdir(root, experiment)  # the same experiment again: its runs resume
    longer = experiment.model_copy(update={"vip": with_overrides(experiment.vip, {"synthetic.steps": 7})})
    with pytest.raises(ValueError, match=r"another experiment \(vip.synthetic.steps is 6 there, 7 now\)"):
        claim_workdir(root, longer)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "render").mkdir()
    with pytest.raises(ValueError, match="holds runs that no experiment.json describes"):
        claim_workdir(tmp_path / "old", experiment)
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["render"]  # nothing written over


def test_a_workdir_record_reads_back_with_new_settings_defaulted_and_a_killed_writers_partial_is_ignored(tmp_path):
    experiment = reproduce_smoke()
    root = tmp_path / "reproduce"
    root.mkdir()
    (root / ".experiment.json.123-456.partial").write_text("{")  # a writer killed before its rename
    claim_workdir(root, experiment)
    record = root / "experiment.json"
    held = json.loads(record.read_text())
    del held["split"]  # a record written before this setting existed: its default applies
    record.write_text(json.dumps(held))
    claim_workdir(root, experiment)
    record.write_text(json.dumps({**held, "retired_setting": 1}))  # a setting this version no longer knows
    with pytest.raises(ValueError, match="holds the runs of an experiment that this version cannot read"):
        claim_workdir(root, experiment)


def test_a_downstream_set_has_each_class_as_a_folder_and_is_reused_with_its_settings_only(tmp_path):
    task = DownstreamTask("counting", 3)
    summary = write_downstream_set(tmp_path / "counting", task, train=20, test=10)
    assert summary == {"output": str(tmp_path / "counting"), "task": "counting-seed3", "train": 20, "val": 10,
                       "classes": 5}
    assert sorted(p.name for p in (tmp_path / "counting" / "train").iterdir()) == sorted(TASK_KINDS["counting"].classes)
    assert sum(1 for _ in (tmp_path / "counting" / "val").rglob("*.png")) == 10
    assert write_downstream_set(tmp_path / "counting", task, train=20, test=10) == summary
    with pytest.raises(ValueError, match="made with other settings"):
        write_downstream_set(tmp_path / "counting", DownstreamTask("counting", 4), train=20, test=10)


def test_every_task_is_probed_and_the_report_gives_five_findings_per_task(tmp_path):
    experiment = _tiny(nonprivate_ceiling=False, block_probes=False)
    checkpoints = _checkpoints(experiment, tmp_path / "run")
    evaluations = {}
    for task in experiment.tasks:
        data = write_downstream_set(tmp_path / task.name, task, train=60, test=40, size=16)["output"]
        evaluations[task.name] = [evaluate_seed(experiment, seed, checkpoints if seed is not None else {}, data,
                                                tmp_path / f"eval-{task.name}-{seed}") for seed in (0, None)]
    report = write_report(experiment, evaluations, [], tmp_path / "report")

    assert [task.kind for task in experiment.tasks] == ["shapes", "textures", "counting"]
    for task in experiment.tasks:
        judged = report["tasks"][task.name]
        assert [f["number"] for f in judged["findings"]] == [1, 2, 3, 4, 5], task
        assert judged["test_examples"] == 40 and "vip-recipe" in judged["arms"] and "raw-pixels" in judged["arms"]
    sections = report["table"].split("### ")[1:]
    assert [section.splitlines()[0] for section in sections] == [
        "shapes (data seed 1)", "textures (data seed 1)", "counting (data seed 1)"]
    for section in sections:
        rows = [line for line in section.splitlines() if line.startswith(tuple(f"| {f.number} | " for f in FINDINGS))]
        assert len(rows) == 5 and all("**" in row for row in rows)
    head = report["table"].split("### ")[0]  # the verdicts table: one row per finding, one column per task
    rows = [line.removesuffix(" |").split(" | ") for line in head.splitlines() if line.startswith("| ")]
    assert rows[0][2:] == ["shapes (data seed 1)", "textures (data seed 1)", "counting (data seed 1)"]
    assert [row[1] for row in rows[1:]] == [f"{f.arm} - {f.baseline} > {f.margin:+.2f}" for f in FINDINGS]
    for column, task in enumerate(experiment.tasks, start=2):
        for row, finding in zip(rows[1:], report["tasks"][task.name]["findings"], strict=True):
            assert row[column].startswith(f"{finding['difference']['mean']:+.3f} [")
            assert row[column].endswith(f"**{finding['verdict']}**")
    assert report["table"].startswith("Split held-out: scoring. Recipe chosen on: shapes (data seed 0), textures")
    assert "Training compute (FLOPs" in report["table"] and "vip-recipe / dp-from-synthetic = 1.000" in report["table"]
    assert report["compute"]["vip-recipe"] == report["compute"]["dp-from-synthetic"] > report["compute"]["synthetic"]


def test_a_report_missing_a_task_is_refused(tmp_path):
    experiment = reproduce_smoke()
    with pytest.raises(ValueError, match=r"no evaluations of tasks \['textures-seed1', 'counting-seed1'\]"):
        write_report(experiment, {"shapes-seed1": []}, [], tmp_path / "report")
