"""A stage flow on a temporary Prefect server: a second run with the same config is Cached, a changed
slice runs again, and the flow run has an MLflow parent run with the stage as its child."""

from __future__ import annotations

from flows.app.run import stage_states
from flows.render import render_flow
from tasks.runtime import tracking
from vip_core.config import tiny, with_overrides


def test_a_second_run_with_the_same_config_skips_the_stage(prefect_api, tmp_path):
    config = with_overrides(tiny(), {"data.render.num_images": 48})
    first = render_flow(config=config, workdir=str(tmp_path), return_state=True)
    second = render_flow(config=config, workdir=str(tmp_path), return_state=True)
    changed = render_flow(config=with_overrides(config, {"data.render.seed": 1}), workdir=str(tmp_path),
                          return_state=True)

    assert first.result()["images"] == second.result()["images"] == 48
    assert [state for _, state in stage_states(first)] == ["Completed"]
    assert [state for _, state in stage_states(second)] == ["Cached"]
    assert [state for _, state in stage_states(changed)] == ["Completed"]
    assert second.result()["output"] == first.result()["output"] != changed.result()["output"]


def test_each_flow_run_has_an_mlflow_parent_run_with_the_stage_as_a_child(prefect_api, tmp_path):
    config = with_overrides(tiny(), {"data.render.num_images": 32})
    state = render_flow(config=config, workdir=str(tmp_path), return_state=True)
    flow_run_id = str(state.state_details.flow_run_id)

    client = tracking.client()
    [parent] = client.search_runs(
        [tracking.experiment_id()], filter_string=f"tags.`{tracking.FLOW_RUN_TAG}` = '{flow_run_id}'")
    assert parent.info.status == "FINISHED"
    assert parent.data.params["data.render.num_images"] == "32"
    assert parent.data.metrics["render.images"] == 32.0
    [child] = tracking.child_runs(parent.info.run_id)
    assert child.data.tags[tracking.STAGE_TAG] == "render"
    assert child.data.metrics["render.images"] == 32.0
