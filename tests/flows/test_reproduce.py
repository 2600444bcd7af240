"""``make reproduce`` at a reduced size through the real flow: render, every arm on Ray Train (the DP runs through
the private step, each on its own private set), the converged probe, the statistics, the table and the plot (about 8 min under load: ``make test-slow``)."""

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
    assert list(result["arms"]) == list(ARMS)
    assert [f["number"] for f in result["findings"]] == [1, 2, 3]
    assert all(f["verdict"] in ("reproduced", "not reproduced", "inconclusive") for f in result["findings"])
    for value in result["arms"].values():
        assert 0 <= value["low"] <= value["mean"] <= value["high"] <= 1
    dp_runs = [p for p in result["privacy"] if p["arm"].startswith("dp-")]
    assert len(dp_runs) == 2 and all(0 < p["epsilon"] <= 8.0 for p in dp_runs)
    assert len({p["dataset_size"] for p in result["privacy"]}) == 1  # the same size, each its own set
    assert Path(result["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 1 | synthetic MAE beats random init" in result["table"]
    assert "wall clock" in "\n".join(summary(result, 60.0))
    states = dict(stage_states(state))
    assert states["pretrain-syn"] == "Completed" and "report" in states

    [parent] = tracking.client().search_runs(
        [tracking.experiment_id()], filter_string=f"tags.`{tracking.FLOW_RUN_TAG}` = '{state.state_details.flow_run_id}'")
    assert parent.data.tags["reproduce.finding1"] == result["findings"][0]["verdict"]
    artifacts = {a.path for a in tracking.client().list_artifacts(parent.info.run_id)}
    assert {"reproduce.png", "reproduce.md", "reproduce.json"} <= artifacts
    ledgers = [json.loads(p.read_text()) for p in Path(state_paths()["ledgers"]).glob("*.json")]
    assert len(ledgers) == 3  # each private run charged its own data set


def test_a_recipe_at_another_compute_is_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--experiment", "smoke", "--recipe", "private.steps=6", "--workdir", "/nonexistent/never-made"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m flows.app.reproduce: error: recipe: its DP stage costs 2.000 x")
