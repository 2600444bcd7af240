"""A new user's way through the UIs, in headless Chromium on real servers: ``make ui``'s Prefect and MLflow
servers and ``make serve``; a run of ``vip-pipeline/tiny`` started from its deployment's Custom run form, its
MLflow run opened from the Prefect artifact link in MLflow's model-training view, ε over the steps found on the
run's charts, and the registered encoder loaded back with ``mlflow.pytorch.load_model``. Screenshots of each
page go to ``test-artifacts/``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from flows.app import servers
from tasks.runtime import tracking

pytestmark = pytest.mark.slow

DEPLOYMENT = "vip-pipeline/tiny"
RUN_TIMEOUT_S = 1800.0


@pytest.fixture(scope="module")
def served(ui_servers, tmp_path_factory):
    """``make serve`` on the Prefect server, logging to the MLflow server (as a team's set-up does, so the
    links point at it); yields the log file once the deployments are served."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "PREFECT_API_URL": f"{ui_servers['prefect'].url}/api",
           "MLFLOW_TRACKING_URI": ui_servers["mlflow"].url}
    command = [sys.executable, "-m", "flows.app.serve", "--web-port", str(servers.free_port())]
    with open(log, "wb") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "Your deployments are being served" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(1.0)
        yield log
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.mark.timeout(RUN_TIMEOUT_S + 600)
def test_a_run_from_the_custom_run_form_shows_epsilon_over_steps_and_registers_a_loadable_model(
        ui_servers, served, page, artifacts_dir, monkeypatch):
    prefect, mlflow_url = ui_servers["prefect"].url, ui_servers["mlflow"].url
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_url)

    # Prefect: Deployments -> vip-pipeline/tiny -> Run -> Custom run: the whole config as a form; submit it.
    deployment_id = _deployment_id(prefect)
    page.goto(f"{prefect}/deployments/deployment/{deployment_id}/run")
    page.get_by_text("Img Size (Optional)", exact=True).wait_for()
    page.screenshot(path=artifacts_dir / "journey-1-prefect-custom-run-form.png")
    page.get_by_role("button", name="Submit").click()
    flow_run_id = _started_flow_run(prefect, deployment_id)

    state = _wait_for_final_state(prefect, flow_run_id)
    assert state == "COMPLETED", f"flow run {flow_run_id} ended {state}: {served.read_text()[-3000:]}"

    # The flow run's artifacts: the link to its MLflow run, in the model-training view.
    page.goto(f"{prefect}/runs/flow-run/{flow_run_id}")
    page.get_by_text("Completed").first.wait_for()
    page.screenshot(path=artifacts_dir / "journey-2-prefect-flow-run.png")
    page.get_by_text("Artifacts", exact=True).first.click()
    page.locator("a", has_text="mlflow-run").first.click()
    link = page.get_by_role("link", name="MLflow run")
    link.wait_for()
    page.screenshot(path=artifacts_dir / "journey-3-prefect-mlflow-run-artifact.png")
    href = link.get_attribute("href")
    assert href.startswith(f"{mlflow_url}/#/experiments/") and href.endswith("?workflowType=machine_learning")

    # MLflow: the parent run in the model-training view (its side bar lists Runs and Models, not GenAI's pages).
    parent = _parent_run(flow_run_id)
    page.goto(href)
    page.get_by_text(parent.info.run_name).first.wait_for()
    page.get_by_text("Parameters").first.wait_for()
    assert page.get_by_text("Observability").count() == 0  # the GenAI view's side bar
    page.screenshot(path=artifacts_dir / "journey-4-mlflow-parent-run.png")

    # Its charts: ε at every step of the private stage.
    history = tracking.client().get_metric_history(parent.info.run_id, "privacy/epsilon")
    steps = int(parent.data.params["private.steps"])
    assert sorted({metric.step for metric in history}) == list(range(1, steps + 1))
    page.get_by_role("tab", name="Model metrics").click()
    page.get_by_placeholder("Search metric charts").wait_for()
    page.get_by_text("privacy", exact=True).first.wait_for()  # charts are drawn as they scroll into view
    assert _chart_sections(page.inner_text("main")) == ["privacy", "Model metrics"]
    chart = page.get_by_text(f"{parent.info.run_name} (privacy/epsilon)").first
    chart.wait_for()
    chart.scroll_into_view_if_needed()
    page.screenshot(path=artifacts_dir / "journey-5-mlflow-parent-epsilon-chart.png")

    # The private stage's own run: its per-step charts lead (privacy, then train), the single values follow.
    [stage] = [run for run in tracking.child_runs(parent.info.run_id)
               if run.data.tags.get(tracking.STAGE_TAG) == "pretrain-dp"]
    page.goto(tracking.run_ui_url(stage.info.run_id, mlflow_url, tab="model-metrics"))
    page.get_by_text("pretrain-dp (privacy/epsilon)").first.wait_for()
    page.get_by_text("Model metrics", exact=True).last.wait_for()
    sections = _chart_sections(page.inner_text("main"))
    assert sections[:2] == ["privacy", "train"] and sections[-1] == "Model metrics", sections
    page.screenshot(path=artifacts_dir / "journey-6-mlflow-pretrain-dp-charts.png")

    # The registered encoder: its page, then loaded back from the registry as a pytorch model.
    [version] = tracking.client().search_model_versions(
        f"name = '{tracking.ENCODER_MODEL_NAME}' and run_id = '{parent.info.run_id}'")
    page.goto(tracking.model_ui_url(tracking.ENCODER_MODEL_NAME, version.version, mlflow_url))
    page.get_by_text(f"Version {version.version}").first.wait_for()
    assert page.get_by_text("Observability").count() == 0
    page.screenshot(path=artifacts_dir / "journey-7-mlflow-registered-model.png")
    import mlflow.pytorch
    import torch

    model = mlflow.pytorch.load_model(f"models:/{tracking.ENCODER_MODEL_NAME}/{version.version}")
    assert isinstance(model, torch.nn.Module)


def _deployment_id(prefect: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: f"{prefect}/api"}), get_client(sync_client=True) as client:
        return str(client.read_deployment_by_name(DEPLOYMENT).id)


def _started_flow_run(prefect: str, deployment_id: str, timeout_s: float = 120.0) -> str:
    """The id of the flow run the form created on the deployment (its only one)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout_s
    only_this = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
    with temporary_settings({PREFECT_API_URL: f"{prefect}/api"}), get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            runs = client.read_flow_runs(deployment_filter=only_this)
            if runs:
                [run] = runs
                return str(run.id)
            time.sleep(1.0)
    pytest.fail(f"no flow run of {DEPLOYMENT} {timeout_s:.0f} s after the form was submitted")


def _wait_for_final_state(prefect: str, flow_run_id: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + RUN_TIMEOUT_S
    with temporary_settings({PREFECT_API_URL: f"{prefect}/api"}), get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            state = client.read_flow_run(flow_run_id).state
            if state is not None and state.is_final():
                return state.type.value
            time.sleep(5.0)
    pytest.fail(f"flow run {flow_run_id} did not finish in {RUN_TIMEOUT_S:.0f} s")


def _parent_run(flow_run_id: str):
    [parent] = tracking.client().search_runs(
        [tracking.experiment_id()], filter_string=f"tags.`{tracking.FLOW_RUN_TAG}` = '{flow_run_id}'")
    return parent


def _chart_sections(text: str) -> list[str]:
    """The run page's chart sections in the order shown: each title is a line followed by ``(<charts>)``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return [line for line, after in zip(lines, lines[1:]) if re.fullmatch(r"\(\d+\)", after)]
