"""``make serve`` in a real browser (headless Chromium): the deployments appear on the Prefect server, the run
form shows the config, and a run started on a deployment runs the flow. Screenshots go to ``test-artifacts/``."""

from __future__ import annotations

import time

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from vip_core.config import tiny, with_overrides


pytestmark = pytest.mark.slow


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


def test_a_run_started_on_a_served_deployment_runs_the_flow(served_deployments, browser, wait_for_text, artifacts_dir):
    from prefect.deployments import run_deployment

    api, process, log = served_deployments
    deployment = _deployment(api, "vip-render/tiny")
    assert deployment.parameters["config"]["name"] == "tiny"
    assert "config" in deployment.parameter_openapi_schema["properties"]

    browser.get(f"{api.removesuffix('/api')}/deployments/deployment/{deployment.id}/run")
    wait_for_text("vip-render", "config")
    browser.save_screenshot(str(artifacts_dir / "prefect-deployment-run-form.png"))

    config = with_overrides(tiny(), {"data.render.num_images": 24}).model_dump(mode="json")
    with temporary_settings({PREFECT_API_URL: api}):
        flow_run = run_deployment("vip-render/tiny", parameters={"config": config}, timeout=600)
    assert flow_run.state.is_completed(), (flow_run.state, log.read_text()[-2000:])
    assert process.poll() is None
