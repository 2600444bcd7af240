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
from tasks.runtime import tracking
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
    wait_for_text(browser, "pretrain-dp", "privacy/epsilon", "train/loss", parent.info.run_name)
    metric = browser.find_element("xpath", "//*[normalize-space(text())='privacy/epsilon']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", metric)
    time.sleep(1.0)
    browser.save_screenshot(str(artifacts_dir / "mlflow-run.png"))


@pytest.fixture(scope="module")
def served_deployments(ui_servers, tmp_path_factory):
    """``make serve`` against the Prefect server, as a subprocess; yields the Prefect API URL."""
    import os
    import subprocess
    import sys

    from flows.app import servers

    api = f"{ui_servers['prefect'].url}/api"
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "PREFECT_API_URL": api}
    command = [sys.executable, "-m", "flows.app.serve", "--web-port", str(servers.free_port())]
    with open(log, "wb") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield api, process, log
    finally:
        process.terminate()
        process.wait(timeout=60)


def _deployment(api: str, name: str, timeout_s: float = 300.0):
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout_s
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            try:
                return client.read_deployment_by_name(name)
            except ObjectNotFound:
                time.sleep(2.0)
    pytest.fail(f"deployment {name} never appeared")


def test_a_run_started_on_a_served_deployment_runs_the_flow(served_deployments, browser, artifacts_dir):
    from prefect.deployments import run_deployment

    api, process, log = served_deployments
    deployment = _deployment(api, "vip-render/tiny")
    assert deployment.parameters["config"]["name"] == "tiny"
    assert "config" in deployment.parameter_openapi_schema["properties"]

    browser.get(f"{api.removesuffix('/api')}/deployments/deployment/{deployment.id}/run")
    wait_for_text(browser, "vip-render", "config")
    browser.save_screenshot(str(artifacts_dir / "prefect-deployment-run-form.png"))

    config = with_overrides(tiny(), {"data.render.num_images": 24}).model_dump(mode="json")
    with temporary_settings({PREFECT_API_URL: api}):
        flow_run = run_deployment("vip-render/tiny", parameters={"config": config}, timeout=600)
    assert flow_run.state.is_completed(), (flow_run.state, log.read_text()[-2000:])
    assert process.poll() is None
