"""A stage flow on a temporary Prefect server: a second run with the same config is Cached, a changed
slice runs again, and the flow run has an MLflow parent run with the stage as its child."""

from __future__ import annotations

import pytest
from prefect.testing.utilities import prefect_test_harness

from flows.render import render_flow
from tasks.runtime import tracking
from vip_core.config import tiny, with_overrides


@pytest.fixture(scope="module")
def prefect_api():
    """A temporary Prefect server on its own sqlite database (slow to start on a loaded machine)."""
    with prefect_test_harness(server_startup_timeout=300):
        yield


def test_a_second_run_with_the_same_config_skips_the_stage(prefect_api, tmp_path):
    config = with_overrides(tiny(), {"data.render.num_images": 48})
    first = render_flow(config=config, workdir=str(tmp_path), return_state=True)
    second = render_flow(config=config, workdir=str(tmp_path), return_state=True)
    changed = render_flow(config=with_overrides(config, {"data.render.seed": 1}), workdir=str(tmp_path),
                          return_state=True)

    assert first.result()["images"] == second.result()["images"] == 48
    assert _task_states(first) == ["Completed"]
    assert _task_states(second) == ["Cached"]
    assert _task_states(changed) == ["Completed"]
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
    assert parent.data.metrics["render/images"] == 32.0
    [child] = tracking.child_runs(parent.info.run_id)
    assert child.data.tags[tracking.STAGE_TAG] == "render"
    assert child.data.metrics["render/images"] == 32.0


def _task_states(flow_state) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id])))
    return [run.state.name for run in runs]
