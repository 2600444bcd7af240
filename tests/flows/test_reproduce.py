"""``make reproduce`` at a reduced size through the real flow: render, every arm on Ray Train (the DP runs through
the private step, each on its own private set), the converged probe on every task, the statistics, the table and the
plot (``make test-slow``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.app.reproduce import main, summary
from flows.app.run import stage_states
from flows.reproduce import reproduce_flow
from tasks.runtime import tracking
from tasks.runtime.environment import state_paths
from vip_core.reproduce import ARMS, reproduce_smoke


@pytest.mark.slow
def test_every_arm_runs_and_each_finding_gets_a_verdict(prefect_api, tmp_path):
    experiment = reproduce_smoke()
    state = reproduce_flow(experiment=experiment, workdir=str(tmp_path), return_state=True)

    assert state.is_completed(), state.message
    result = state.result()
    experiment_tasks = [task.name for task in experiment.tasks]
    assert list(result["tasks"]) == experiment_tasks == ["shapes-seed1", "textures-seed1", "counting-seed1"]
    for task in result["tasks"].values():
        assert list(task["arms"]) == list(ARMS)
        assert [f["number"] for f in task["findings"]] == [1, 2, 3, 4, 5]
        assert all(f["verdict"] in ("reproduced", "not reproduced", "inconclusive") for f in task["findings"])
        for value in task["arms"].values():
            assert 0 <= value["low"] <= value["mean"] <= value["high"] <= 1
    dp_runs = [p for p in result["privacy"] if p["arm"] in ("dp-from-synthetic", "vip-recipe", "dp-from-random")]
    assert len(dp_runs) == 3 and all(0 < p["epsilon"] <= 8.0 for p in dp_runs)
    assert len({p["dataset_size"] for p in result["privacy"]}) == 1  # the same size, each its own set
    assert result["compute"]["vip-recipe"] == result["compute"]["dp-from-synthetic"]
    assert Path(result["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 1 | synthetic MAE beats random init" in result["table"] and "### counting (data seed 1)" in result["table"]
    printed = "\n".join(summary(result, 60.0))
    assert "wall clock" in printed and printed.count("(5) DP from synthetic beats raw pixels: ") == 3
    states = dict(stage_states(state))
    assert states["pretrain-syn"] == "Completed" and "report" in states

    [parent] = tracking.client().search_runs(
        [tracking.experiment_id()], filter_string=f"tags.`{tracking.FLOW_RUN_TAG}` = '{state.state_details.flow_run_id}'")
    assert parent.data.tags["reproduce.counting-seed1.finding5"] == result["tasks"]["counting-seed1"]["findings"][4]["verdict"]
    artifacts = {a.path for a in tracking.client().list_artifacts(parent.info.run_id)}
    assert {"reproduce.png", "reproduce.md", "reproduce.json"} <= artifacts
    ledgers = [json.loads(p.read_text()) for p in Path(state_paths()["ledgers"]).glob("*.json")]
    assert len(ledgers) == 4  # each private run charged its own data set


def test_a_recipe_at_another_compute_is_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--experiment", "smoke", "--recipe", "private.steps=6", "--workdir", "/nonexistent/never-made"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m flows.app.reproduce: error: recipe: its DP stage costs 2.000 x")
