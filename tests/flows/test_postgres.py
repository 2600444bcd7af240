"""A team set-up: the Prefect server and the MLflow server on PostgreSQL (Debian's server, started here).

A flow run through both servers leaves its flow run in Prefect's database, its parent and child runs in
MLflow's, and its artifacts in the artifact folder the MLflow server proxies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import psycopg2
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.render import render_flow
from flows.app import servers
from tasks.runtime import tracking
from vip_core.config import tiny, with_overrides

pytestmark = pytest.mark.slow

USER = "vip"


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
