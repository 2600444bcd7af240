"""A supervised command's MLflow runs when it is stopped or dies: the runs it opened and left open are ended, as the
MLflow UI then shows them, and runs it ended itself keep their status. Each command runs in a session of its own,
as a shell starts it, on the test session's MLflow store (``MLFLOW_TRACKING_URI`` is inherited)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tasks.runtime import tracking
from tests.tasks.conftest import wait_until_session_ends

ROOT = Path(__file__).resolve().parents[3]

# The supervised child, as a command's: watches its supervisor, leaves a process running in a group of its own whose
# parent has exited (as Ray's daemons do), opens a run it ends, then one it leaves open, prints their ids, then waits
# or dies.
CHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    if len(sys.argv) > 2:
        os.environ["MLFLOW_TRACKING_URI"] = sys.argv[2]  # the supervisor's store is out of reach: this one is not
    from tasks.runtime import tracking
    from tasks.runtime.stopping import stop_with_supervisor
    stop_with_supervisor()
    daemon = "import subprocess; subprocess.Popen(['sleep', '600'], process_group=0)"
    subprocess.run([sys.executable, "-c", daemon], check=True)
    ended = tracking.start_run("ended by the command")
    tracking.end_run(ended)
    left = tracking.start_run("left open")
    print(ended, left, flush=True)
    if sys.argv[1] == "die":
        os._exit(3)
    time.sleep(600)
""")


def _supervised(tmp_path: Path, how: str, supervisor_store: str | None = None) -> tuple[subprocess.Popen, Path]:
    """The child under ``run_supervised``; ``supervisor_store``: the supervisor's MLflow URI, where not the child's."""
    tracking.experiment_id()  # the store made here first: two processes making one sqlite store would collide
    log = tmp_path / f"{how}.log"
    child = [CHILD, how] + ([os.environ["MLFLOW_TRACKING_URI"]] if supervisor_store else [])
    program = ("import sys\nfrom tasks.runtime.stopping import run_supervised\n"
               f"sys.exit(run_supervised([sys.executable, '-c', *{child!r}], stopped=lambda: 'stopped'))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if supervisor_store:
        env["MLFLOW_TRACKING_URI"] = supervisor_store
    with open(log, "wb") as output:
        process = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, stdout=output,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                   env=env)
    return process, log


def _run_ids(log: Path, process: subprocess.Popen, timeout_s: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while not log.read_text().strip():
        assert process.poll() is None or log.read_text().strip(), f"exited {process.returncode}: {log.read_text()}"
        assert time.monotonic() < deadline, "the child opened no run"
        time.sleep(0.2)
    return log.read_text().split()[:2]


def _status(run_id: str) -> str:
    return tracking.client().get_run(run_id).info.status


def test_ctrl_c_marks_the_runs_the_command_left_open_killed(tmp_path):
    process, log = _supervised(tmp_path, "wait")
    ended, left = _run_ids(log, process)
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=60) == 130, log.read_text()
    assert (_status(ended), _status(left)) == ("FINISHED", "KILLED")


def test_a_sigkill_of_the_supervisor_stops_everything_the_command_started_and_marks_its_open_runs_killed(tmp_path):
    process, log = _supervised(tmp_path, "wait")
    ended, left = _run_ids(log, process)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    wait_until_session_ends(process.pid)
    assert (_status(ended), _status(left)) == ("FINISHED", "KILLED")


def test_a_command_that_dies_leaves_its_open_runs_failed(tmp_path):
    process, log = _supervised(tmp_path, "die")
    assert process.wait(timeout=120) == 3, log.read_text()
    ended, left = _run_ids(log, process)
    assert (_status(ended), _status(left)) == ("FINISHED", "FAILED")


def test_runs_are_noted_for_the_supervisor_and_a_process_without_its_folder_still_opens_them(tmp_path, monkeypatch):
    """A process of the command notes each run it opens; one on another node, where the supervisor's folder does not
    exist, opens its run all the same (it is not noted)."""
    from tasks.runtime.stopping import OPENED_RUNS_ENV

    notes = tmp_path / "mlflow-runs"
    monkeypatch.setenv(OPENED_RUNS_ENV, str(notes))
    noted = tracking.start_run("noted")
    monkeypatch.setenv(OPENED_RUNS_ENV, str(tmp_path / "absent" / "mlflow-runs"))
    elsewhere = tracking.start_run("on another node")
    assert notes.read_text().split() == [noted]
    assert _status(elsewhere) == "RUNNING"
    for run_id in (noted, elsewhere):
        tracking.end_run(run_id)


def test_a_store_out_of_reach_leaves_the_runs_open_and_the_command_still_stops_within_seconds(tmp_path):
    """The supervisor's tracking server does not answer (a closed port on 127.0.0.1, which MLflow's client retries for
    minutes): the stop waits for it at most ENDING_RUNS_S."""
    from tasks.runtime.stopping import ENDING_RUNS_S

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    process, log = _supervised(tmp_path, "wait", supervisor_store=f"http://127.0.0.1:{port}")
    _, left = _run_ids(log, process)
    started = time.monotonic()
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=120) == 130, log.read_text()
    assert time.monotonic() - started < ENDING_RUNS_S + 15
    assert _status(left) == "RUNNING"
    tracking.end_run(left)
