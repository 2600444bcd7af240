"""In a real browser (headless Chromium): the flow run in the Prefect UI, privacy/epsilon in the MLflow UI.

The servers are started as ``make ui`` starts them, on the test session's stores; the flow runs are real
stages on a micro config. Screenshots are kept in ``test-artifacts/``.
"""

from __future__ import annotations

import time

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.pretrain import pretrain_dp_flow
from flows.render import render_flow
from tasks import tracking
from vip_core.config import tiny, with_overrides

pytestmark = pytest.mark.slow

MICRO = {
    "data.render.num_images": 96,
    "private.batch_size": 16, "private.physical_batch_size": 16, "private.steps": 3, "private.warmup_steps": 0,
}


def wait_for_text(browser, *texts: str, timeout_s: float = 120.0) -> str:
    """The page's text once it holds every one of ``texts``; fails naming the missing ones."""
    deadline = time.monotonic() + timeout_s
    body = ""
    while time.monotonic() < deadline:
        body = browser.find_element("tag name", "body").text
        if all(text in body for text in texts):
            return body
        time.sleep(1.0)
    missing = [text for text in texts if text not in body]
    pytest.fail(f"{browser.current_url} never showed {missing}; it showed: {body[:500]!r}")


@pytest.fixture(scope="module")
def private_flow_run(ui_servers, tmp_path_factory):
    """The private pre-training flow run on rendered images, against the Prefect server."""
    workdir = tmp_path_factory.mktemp("runs")
    config = with_overrides(tiny(), MICRO)
    with temporary_settings({PREFECT_API_URL: f"{ui_servers['prefect'].url}/api"}):
        rendered = render_flow(config=config, workdir=str(workdir))
        state = pretrain_dp_flow(config=config, data=rendered["output"], workdir=str(workdir), return_state=True)
    assert state.is_completed(), state.message
    return state


def test_the_prefect_ui_shows_the_flow_run(ui_servers, private_flow_run, browser, artifacts_dir):
    from prefect.client.orchestration import get_client

    flow_run_id = private_flow_run.state_details.flow_run_id
    with temporary_settings({PREFECT_API_URL: f"{ui_servers['prefect'].url}/api"}):
        with get_client(sync_client=True) as client:
            name = client.read_flow_run(flow_run_id).name
    browser.get(f"{ui_servers['prefect'].url}/runs/flow-run/{flow_run_id}")
    wait_for_text(browser, name, "vip-pretrain-dp", "Completed", "pretrain-private")
    browser.save_screenshot(str(artifacts_dir / "prefect-flow-run.png"))


def test_the_mlflow_ui_shows_epsilon_of_the_private_stage(ui_servers, private_flow_run, browser, artifacts_dir):
    flow_run_id = str(private_flow_run.state_details.flow_run_id)
    [parent] = tracking.client().search_runs(
        [tracking.experiment_id()], filter_string=f"tags.`{tracking.FLOW_RUN_TAG}` = '{flow_run_id}'")
    [child] = [run for run in tracking.child_runs(parent.info.run_id)
               if run.data.tags.get(tracking.STAGE_TAG) == "pretrain-dp"]
    history = tracking.client().get_metric_history(child.info.run_id, "privacy/epsilon")
    assert [metric.step for metric in history] == [1, 2, 3]

    browser.get(tracking.run_ui_url(child.info.run_id, ui_servers["mlflow"].url))
    wait_for_text(browser, "pretrain-dp", "privacy/epsilon", parent.info.run_name)
    browser.save_screenshot(str(artifacts_dir / "mlflow-run.png"))
    browser.get(tracking.run_ui_url(child.info.run_id, ui_servers["mlflow"].url, tab="model-metrics"))
    wait_for_text(browser, "privacy/epsilon", "train/loss")
    browser.save_screenshot(str(artifacts_dir / "mlflow-run-charts.png"))
