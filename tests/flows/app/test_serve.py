"""``make serve``: it serves on the ``make ui`` server and nowhere else, stops on Ctrl-C within seconds with
its deployments paused, and in a real browser (headless Chromium) the deployments appear on the Prefect
server, the run form shows the config, and a run started on a deployment runs the flow. Screenshots go to
``test-artifacts/``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.app import servers
from vip_core.config import tiny, with_overrides

SERVE = [sys.executable, "-m", "flows.app.serve"]
DEPLOYMENTS = ("vip-pipeline/tiny", "vip-ingest/tiny", "vip-render/tiny", "vip-pretrain-syn/tiny",
               "vip-pretrain-dp/tiny", "vip-eval/tiny", "vip-audit/tiny")


def test_without_a_prefect_server_it_stops_with_one_line():
    api = f"{servers.prefect_url(servers.free_port())}/api"
    result = subprocess.run(SERVE, env={**os.environ, "PREFECT_API_URL": api}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"make serve: error: no Prefect server answers at {api}; start it with "
                                     "`make ui` (or set PREFECT_API_URL to a running server)")


@pytest.mark.slow
def test_ctrl_c_stops_it_within_seconds_with_the_deployments_paused(ui_servers, tmp_path):
    api = f"{ui_servers['prefect'].url}/api"
    log = tmp_path / "serve.log"
    command = [*SERVE, "--web-port", str(servers.free_port())]
    with open(log, "wb") as output:
        process = subprocess.Popen(command, env={**os.environ, "PREFECT_API_URL": api}, stdout=output,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deployments = [_deployment(api, name) for name in DEPLOYMENTS]
        assert not any(deployment.paused for deployment in deployments)
        _wait_for_line(log, "Your deployments are being served", process)
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground process group
        started = time.monotonic()
        returncode = process.wait(timeout=60)
        seconds = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
    output = log.read_text()
    assert returncode == 0, output[-2000:]
    assert seconds < 10, output[-2000:]
    assert "Traceback" not in output, output[-2000:]
    assert "make serve: stopped; the deployments are paused" in output
    assert {name: _deployment(api, name).paused for name in DEPLOYMENTS} == dict.fromkeys(DEPLOYMENTS, True), output[-3000:]


@pytest.fixture(scope="module")
def served_deployments(ui_servers, tmp_path_factory):
    """``make serve`` against the Prefect server, as a subprocess; yields the Prefect API URL."""
    api = f"{ui_servers['prefect'].url}/api"
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "PREFECT_API_URL": api}
    command = [*SERVE, "--web-port", str(servers.free_port())]
    with open(log, "wb") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield api, process, log
    finally:
        process.terminate()
        process.wait(timeout=60)


def _wait_for_line(log, text: str, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.5)


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


@pytest.mark.slow
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
