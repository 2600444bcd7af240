"""The Prefect server and the MLflow server on 127.0.0.1: started for ``make ui`` and by the tests.

Both keep their state in the default stores under ``$VIP_HOME`` (Prefect's sqlite in ``$PREFECT_HOME``,
MLflow's sqlite and artifacts in ``$VIP_HOME/mlflow``) unless a database is named, as a team set-up does
with PostgreSQL (``PREFECT_API_DATABASE_CONNECTION_URL``, ``VIP_MLFLOW_BACKEND_STORE_URI``,
``VIP_MLFLOW_ARTIFACTS_DESTINATION``; see ``infra/postgres``).

``python -m flows.app.servers ui`` starts whichever of the two is not already running, prints the URLs and
serves until interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import psutil

from tasks.runtime.environment import configure_environment, state_paths
from tasks.runtime.stopping import INTERRUPTED

HOST = "127.0.0.1"
PREFECT_PORT = 4200
MLFLOW_PORT = 5000
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Service:
    """A server process this module started, with where it answers and where it logs."""

    name: str
    url: str
    health_url: str
    process: subprocess.Popen
    log_path: Path


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def prefect_url(port: int = PREFECT_PORT) -> str:
    return f"http://{HOST}:{port}"


def mlflow_url(port: int = MLFLOW_PORT) -> str:
    return f"http://{HOST}:{port}"


def is_healthy(health_url: str, timeout_s: float = 2.0) -> bool:
    """True when ``health_url`` answers 200."""
    try:
        with urllib.request.urlopen(health_url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def prefect_health_url(port: int = PREFECT_PORT) -> str:
    return f"{prefect_url(port)}/api/health"


def mlflow_health_url(port: int = MLFLOW_PORT) -> str:
    return f"{mlflow_url(port)}/health"


def start_prefect_server(
    *, port: int = PREFECT_PORT, database_url: str | None = None, log_dir: Path | None = None
) -> Service:
    """Starts ``prefect server start`` on 127.0.0.1 and waits until it is healthy.

    Args:
        port: the port of the API and the UI.
        database_url: a SQLAlchemy URL (``postgresql+asyncpg://...``); None: Prefect's own setting
            (``PREFECT_API_DATABASE_CONNECTION_URL``, a team's PostgreSQL), else sqlite in ``$PREFECT_HOME``.
        log_dir: where the server's output goes; default ``$VIP_HOME/logs``.
    """
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    env["PREFECT_UI_API_URL"] = f"{prefect_url(port)}/api"
    if database_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    command = [_venv_bin("prefect"), "server", "start", "--host", HOST, "--port", str(port)]
    return _start("prefect", command, env, prefect_url(port), prefect_health_url(port), log_dir)


def start_mlflow_server(
    *,
    port: int = MLFLOW_PORT,
    backend_store_uri: str | None = None,
    artifacts_destination: str | None = None,
    log_dir: Path | None = None,
) -> Service:
    """Starts ``mlflow server`` on 127.0.0.1 (job execution off) and waits until it is healthy.

    Args:
        port: the port of the tracking API and the UI.
        backend_store_uri: the run and registry store; default ``$VIP_MLFLOW_BACKEND_STORE_URI`` (a team's
            PostgreSQL, see ``infra/postgres``), else the sqlite file in ``$VIP_HOME/mlflow``.
        artifacts_destination: where artifacts go; default ``$VIP_MLFLOW_ARTIFACTS_DESTINATION``, else
            ``$VIP_HOME/mlflow/artifacts``.
        log_dir: where the server's output goes; default ``$VIP_HOME/logs``.
    """
    paths = state_paths()
    backend_store_uri = (backend_store_uri or os.environ.get("VIP_MLFLOW_BACKEND_STORE_URI")
                         or f"sqlite:///{paths['mlflow_db']}")
    artifacts_destination = (artifacts_destination or os.environ.get("VIP_MLFLOW_ARTIFACTS_DESTINATION")
                             or str(paths["mlflow_artifacts"]))
    env = dict(os.environ)
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    command = [
        _venv_bin("mlflow"), "server",
        "--backend-store-uri", backend_store_uri,
        "--artifacts-destination", artifacts_destination,
        "--host", HOST, "--port", str(port), "--workers", "1",
    ]
    return _start("mlflow", command, env, mlflow_url(port), mlflow_health_url(port), log_dir)


def stop(service: Service, timeout_s: float = 20.0) -> None:
    """Stops the server and the processes it started (its own process group)."""
    if service.process.poll() is not None:
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        _stop_group(psutil.Process(service.process.pid), timeout_s)
    service.process.wait()


def noted(service: Service) -> str:
    """How another process finds ``service`` again (:func:`stop_noted`): its process id and start time."""
    return f"{service.process.pid} {psutil.Process(service.process.pid).create_time()!r}"


def stop_noted(note: str, timeout_s: float = 20.0) -> None:
    """:func:`stop` from a process that did not start the server: the one ``note`` (:func:`noted`) names, unless it
    has ended (a process that took its id since is left alone)."""
    pid, started = note.split()
    with contextlib.suppress(psutil.NoSuchProcess):
        server = psutil.Process(int(pid))
        if repr(server.create_time()) == started:
            _stop_group(server, timeout_s)


def _stop_group(leader: psutil.Process, timeout_s: float) -> None:
    """SIGTERM to ``leader``'s process group, SIGKILL after ``timeout_s``; returns once the leader has exited (a
    zombie counts: its parent, maybe not this process, reaps it)."""
    with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
        os.killpg(leader.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while leader.status() != psutil.STATUS_ZOMBIE:
            if time.monotonic() > deadline:
                os.killpg(leader.pid, signal.SIGKILL)
                return
            time.sleep(0.1)


@contextlib.contextmanager
def running(*services: Service) -> Iterator[tuple[Service, ...]]:
    """Stops the given services on exit, whatever happens inside."""
    try:
        yield services
    finally:
        for service in reversed(services):
            stop(service)


def _start(name: str, command: list[str], env: dict[str, str], url: str, health_url: str,
           log_dir: Path | None) -> Service:
    if is_healthy(health_url):
        raise RuntimeError(f"{name}: something already answers at {url}; stop it or choose another port")
    log_dir = log_dir or state_paths()["home"] / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-server.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    service = Service(name=name, url=url, health_url=health_url, process=process, log_path=log_path)
    try:
        _wait_healthy(service)
    except BaseException:  # not healthy, or interrupted while waiting: never leave the server behind
        stop(service)
        raise
    return service


def _wait_healthy(service: Service, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if service.process.poll() is not None:
            raise RuntimeError(
                f"{service.name} server exited with code {service.process.returncode}; "
                f"see {service.log_path}: {_tail(service.log_path)}"
            )
        if is_healthy(service.health_url):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{service.name} server not healthy after {timeout_s:.0f} s; see {service.log_path}")


def _tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])


def _venv_bin(name: str) -> str:
    """The console script next to this interpreter (the venv's), else the one on PATH."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def cancel_flow_run(api_url: str, flow_run_id: str, message: str) -> None:
    """Marks a flow run whose process was stopped, and its task runs still open, Cancelled (through the REST API, so
    that the supervisor of a run need not import Prefect); a server that does not answer is left as it is."""
    open_states = {"state": {"type": {"any_": ["SCHEDULED", "PENDING", "RUNNING"]}}}
    body = {"state": {"type": "CANCELLED", "name": "Cancelled", "message": message}, "force": True}
    with contextlib.suppress(OSError, ValueError):
        tasks = _post(f"{api_url}/task_runs/filter",
                      {"flow_runs": {"id": {"any_": [flow_run_id]}}, "task_runs": open_states})
        for task_run in tasks:
            _post(f"{api_url}/task_runs/{task_run['id']}/set_state", body)
        _post(f"{api_url}/flow_runs/{flow_run_id}/set_state", body)


def _post(url: str, payload: dict) -> Any:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read() or b"null")


def use_running_prefect_server() -> str | None:
    """Points Prefect at ``make ui``'s server when it runs (the run then shows live); else None.

    Without it, Prefect starts a temporary server on the same database, and ``make ui`` shows the run later.
    """
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    if is_healthy(prefect_health_url()):
        os.environ["PREFECT_API_URL"] = f"{prefect_url()}/api"
        return os.environ["PREFECT_API_URL"]
    return None


def serve_ui() -> int:
    """Starts the servers that are not running yet, prints the URLs, and serves until interrupted."""
    home = configure_environment()
    started: list[Service] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the servers on `kill` as on Ctrl-C
    try:
        if not is_healthy(prefect_health_url()):
            started.append(start_prefect_server())
        if not is_healthy(mlflow_health_url()):
            started.append(start_mlflow_server())
        prefect_store = ("PREFECT_API_DATABASE_CONNECTION_URL" if os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL")
                         else home / "prefect")
        mlflow_store = ("VIP_MLFLOW_BACKEND_STORE_URI" if os.environ.get("VIP_MLFLOW_BACKEND_STORE_URI")
                        else home / "mlflow")
        print(f"Prefect UI: {prefect_url()}   (flow runs, deployments; state: {prefect_store})")
        print(f"MLflow UI:  {mlflow_url()}   (runs, metrics, registered models; state: {mlflow_store})")
        print(f"  the runs: {_experiment_url()}")
        if not started:
            print("Both servers were already running; nothing to do.")
            return 0
        print("Serving; press Ctrl-C to stop.", flush=True)
        while all(service.process.poll() is None for service in started):
            time.sleep(1.0)
        exited = [service for service in started if service.process.poll() is not None]
        for service in exited:
            print(f"{service.name} server exited; see {service.log_path}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nStopping the servers; their runs and models stay in their stores (`make ui` serves them again).",
              flush=True)
        return INTERRUPTED
    finally:
        for service in reversed(started):
            stop(service)


def _experiment_url() -> str:
    """The experiment's runs in the MLflow UI's model-training view (not its GenAI view, MLflow 3's default)."""
    from tasks.runtime import tracking

    return tracking.experiment_ui_url(mlflow_url())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.app.servers", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["ui"], help="ui: the Prefect UI and the MLflow UI on 127.0.0.1")
    parser.parse_args(argv)
    return serve_ui()


if __name__ == "__main__":
    sys.exit(main())
