"""The servers ``make ui`` starts, in a real browser (headless Chromium): a flow run in the Prefect UI and
privacy/epsilon in the MLflow UI; and a team's set-up of both servers on PostgreSQL (Debian's server, started
here), where a flow run leaves its flow run in Prefect's database, its parent and child runs in MLflow's and
its artifacts in the folder the MLflow server proxies. Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import psycopg2
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.app import servers
from flows.app.run import run_target
from flows.render import render_flow
from tasks.runtime import tracking
from vip_core.config import tiny, with_overrides

pytestmark = pytest.mark.slow

MICRO = {
    "data.render.num_images": 96,
    "synthetic.steps": 2, "synthetic.warmup_steps": 0,
    "private.batch_size": 16, "private.physical_batch_size": 16, "private.steps": 3, "private.warmup_steps": 0,
}
USER = "vip"


@pytest.fixture(scope="module")
def private_flow_run(ui_servers, tmp_path_factory):
    """``make pretrain-dp`` on a micro config and a small sample web, against the Prefect server."""
    options = {"workdir": str(tmp_path_factory.mktemp("runs")), "web_port": servers.free_port(), "images": 40}
    with temporary_settings({PREFECT_API_URL: f"{ui_servers['prefect'].url}/api"}):
        state = run_target("pretrain-dp", with_overrides(tiny(), MICRO), **options)
    assert state.is_completed(), state.message
    return state


def test_the_prefect_ui_shows_the_flow_run(ui_servers, private_flow_run, browser, wait_for_text, artifacts_dir):
    from prefect.client.orchestration import get_client

    flow_run_id = private_flow_run.state_details.flow_run_id
    with temporary_settings({PREFECT_API_URL: f"{ui_servers['prefect'].url}/api"}):
        with get_client(sync_client=True) as client:
            name = client.read_flow_run(flow_run_id).name
    browser.get(f"{ui_servers['prefect'].url}/runs/flow-run/{flow_run_id}")
    wait_for_text(name, "vip-pretrain-dp", "Completed", "pretrain-syn", "pretrain-dp")
    browser.save_screenshot(str(artifacts_dir / "prefect-flow-run.png"))


def test_the_mlflow_ui_shows_epsilon_of_the_private_stage(ui_servers, private_flow_run, browser, wait_for_text, artifacts_dir):
    flow_run_id = str(private_flow_run.state_details.flow_run_id)
    [parent] = tracking.client().search_runs(
        [tracking.experiment_id()], filter_string=f"tags.`{tracking.FLOW_RUN_TAG}` = '{flow_run_id}'")
    [child] = [run for run in tracking.child_runs(parent.info.run_id)
               if run.data.tags.get(tracking.STAGE_TAG) == "pretrain-dp"]
    history = tracking.client().get_metric_history(child.info.run_id, "privacy/epsilon")
    assert [metric.step for metric in history] == [1, 2, 3]

    browser.get(tracking.run_ui_url(child.info.run_id, ui_servers["mlflow"].url))
    wait_for_text("pretrain-dp", "privacy/epsilon", "train/lr", parent.info.run_name)
    metric = browser.find_element("xpath", "//*[normalize-space(text())='privacy/epsilon']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", metric)
    time.sleep(1.0)
    browser.save_screenshot(str(artifacts_dir / "mlflow-run.png"))


def _as_postgres(command: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run the command as the ``postgres`` system user."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@pytest.fixture(scope="module")
def postgres(system_programs) -> Iterator[str]:
    """A fresh PostgreSQL cluster in a temporary folder on 127.0.0.1 with databases prefect and mlflow;
    yields ``host:port``."""
    bin_dir = sorted(Path("/usr/lib/postgresql").glob("*/bin"))[-1]
    folder = Path(tempfile.mkdtemp(prefix="vip-pg-"))
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres", "postgres")
    port = servers.free_port()
    data, log = folder / "data", folder / "server.log"
    subprocess.run(_as_postgres([str(bin_dir / "initdb"), "-D", str(data), "-U", USER, "--auth=trust"]),
                   check=True, capture_output=True)
    start = _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "120", "start",
                          "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1"])
    result = subprocess.run(start, capture_output=True, text=True)
    if result.returncode:
        pytest.fail(f"PostgreSQL did not start: {result.stdout}{result.stderr} {log.read_text()[-500:]}")
    try:
        connection = psycopg2.connect(host="127.0.0.1", port=port, user=USER, dbname="postgres")
        connection.autocommit = True  # CREATE DATABASE cannot run inside a transaction
        with connection.cursor() as cursor:
            cursor.execute("CREATE DATABASE prefect")
            cursor.execute("CREATE DATABASE mlflow")
        connection.close()
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run(_as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
                       capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def _rows(address: str, database: str, query: str, *parameters) -> list[tuple]:
    host, port = address.split(":")
    with psycopg2.connect(host=host, port=int(port), user=USER, dbname=database) as connection:
        with connection.cursor() as cursor:
            cursor.execute(query, parameters)
            return cursor.fetchall()


def test_a_flow_run_is_recorded_in_postgresql_by_both_servers(postgres, tmp_path, monkeypatch):
    artifacts = tmp_path / "mlflow-artifacts"
    prefect = servers.start_prefect_server(
        port=servers.free_port(), database_url=f"postgresql+asyncpg://{USER}@{postgres}/prefect", log_dir=tmp_path)
    with servers.running(prefect):
        mlflow = servers.start_mlflow_server(
            port=servers.free_port(), backend_store_uri=f"postgresql+psycopg2://{USER}@{postgres}/mlflow",
            artifacts_destination=str(artifacts), log_dir=tmp_path)
        with servers.running(mlflow):
            monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow.url)
            with temporary_settings({PREFECT_API_URL: f"{prefect.url}/api"}):
                state = render_flow(config=with_overrides(tiny(), {"data.render.num_images": 32}),
                                    workdir=str(tmp_path / "runs"), return_state=True)
    assert state.is_completed(), state.message
    flow_run_id = str(state.state_details.flow_run_id)

    assert _rows(postgres, "prefect", "SELECT state_type FROM flow_run WHERE id = %s", flow_run_id) == [("COMPLETED",)]
    [(parent_id, parent_name)] = _rows(
        postgres, "mlflow",
        "SELECT r.run_uuid, r.name FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
        "WHERE t.key = %s AND t.value = %s", tracking.FLOW_RUN_TAG, flow_run_id)
    assert parent_name.startswith("vip-render/")
    children = _rows(postgres, "mlflow", "SELECT r.name, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                     "WHERE t.key = %s AND t.value = %s", tracking.PARENT_TAG, parent_id)
    assert children == [("render", "FINISHED")]
    assert any(path.name == "config.json" for path in artifacts.rglob("*"))
