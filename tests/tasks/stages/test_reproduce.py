"""The reproduce experiment's evaluation stage at a reduced size: every encoder arm probed on all blocks and, as a
diagnostic, on each block alone; the report's table shows both."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.stages.reproduce import claim_workdir, evaluate_seed, write_downstream_set, write_report
from vip_core.config import with_overrides
from vip_core.models import build_mae, save_checkpoint
from vip_core.reproduce import reproduce_smoke

TRAINED_ARMS = ("synthetic", "dp-from-synthetic", "dp-from-random")


@pytest.fixture(scope="module")
def downstream(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reproduce") / "downstream"
    write_downstream_set(folder, train=60, test=60, seed=0)
    return folder


def _checkpoints(experiment, folder) -> dict[str, str]:
    torch.manual_seed(7)  # one trained-looking encoder for every trained arm: other weights than random-init's
    checkpoint = save_checkpoint(folder, model=build_mae(experiment.vip.model), config=experiment.vip,
                                 stage="private", step=0)
    return {arm: str(checkpoint) for arm in TRAINED_ARMS}


def test_each_encoder_arm_is_also_probed_block_by_block_and_the_table_shows_it(downstream, tmp_path):
    experiment = reproduce_smoke().model_copy(update={"nonprivate_ceiling": False})
    checkpoints = _checkpoints(experiment, tmp_path / "run")
    encoders = evaluate_seed(experiment, 0, checkpoints, downstream, tmp_path / "seed0")
    pixels = evaluate_seed(experiment, None, {}, downstream, tmp_path / "pixels")

    depth = experiment.vip.model.depth
    for arm, result in encoders["arms"].items():
        assert len(result["blocks_top1"]) == depth and all(0 <= v <= 1 for v in result["blocks_top1"]), arm
    assert encoders["arms"]["random-init"]["blocks_top1"] != encoders["arms"]["synthetic"]["blocks_top1"]
    assert "blocks_top1" not in pixels["arms"]["raw-pixels"]

    report = write_report(experiment, [encoders, pixels], [], tmp_path / "report")
    assert report["blocks"]["random-init"] == encoders["arms"]["random-init"]["blocks_top1"]  # one seed: its values
    assert "Diagnostic, decided by no finding" in report["table"]
    row = next(line for line in report["table"].splitlines() if line.startswith("| random-init |") and
               line.count("|") == depth + 3)
    assert f"{encoders['arms']['random-init']['blocks_top1'][0]:.3f}" in row


def test_without_block_probes_the_table_has_no_diagnostic(downstream, tmp_path):
    experiment = reproduce_smoke().model_copy(update={"nonprivate_ceiling": False, "block_probes": False})
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
    del held["block_probes"]  # a record written before this setting existed: its default applies
    record.write_text(json.dumps(held))
    claim_workdir(root, experiment)
    record.write_text(json.dumps({**held, "retired_setting": 1}))  # a setting this version no longer knows
    with pytest.raises(ValueError, match="holds the runs of an experiment that this version cannot read"):
        claim_workdir(root, experiment)
