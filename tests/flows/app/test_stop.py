"""Ctrl-C and the confirmation, as a person at a terminal meets them.

Each command starts as a terminal starts it: in a process group of its own (a session here), which gets the SIGINT
that Ctrl-C sends. Every process the command starts inherits a marker variable; the tests look for any process
with the marker, or in the session, left running. The ``make run`` and ``vip pretrain`` tests are slow (1 to 2 min
each here: a run up to its first training checkpoint, then the rerun).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from flows.app.servers import free_port
from tasks.runtime.sizing import Devices

ROOT = Path(__file__).resolve().parents[3]
STOP_WITHIN_S = 30.0


class Terminal:
    """A command started in a session of its own, as a shell starts it, its output collected in a file."""

    def __init__(self, command: list[str], home: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.marker = uuid.uuid4().hex
        self.log = log
        env = {**os.environ, "VIP_HOME": str(home), "VIP_TEST_MARKER": self.marker, **(env or {})}
        with open(log, "wb") as output:
            self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            assert self.process.poll() is None, f"exited {self.process.returncode} before {text!r}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s:.0f} s:\n{self.output()[-3000:]}"
            time.sleep(0.5)

    def its_processes(self) -> list[str]:
        """The processes this command started that are still running (by marker or by session)."""
        return _left_running(self.marker, session=self.process.pid)

    def ctrl_c(self) -> float:
        """Ctrl-C: SIGINT to the command's process group; returns the seconds until none of its processes is left."""
        assert self.its_processes(), "nothing running to stop"
        os.killpg(self.process.pid, signal.SIGINT)
        seconds = self.wait_until_gone()
        self.process.wait(timeout=5)
        return seconds

    def wait_until_gone(self) -> float:
        """The seconds until none of this command's processes is left, at most :data:`STOP_WITHIN_S`; past it, kills
        those left (a failed test leaves nothing going) and fails naming them."""
        started = time.monotonic()
        while left := self.its_processes():
            if time.monotonic() - started >= STOP_WITHIN_S:
                for process in left:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        psutil.Process(int(process.split()[0])).kill()
                raise AssertionError(f"still running: {left}")
            time.sleep(0.5)
        return time.monotonic() - started


@pytest.mark.slow
def test_ctrl_c_on_make_run_stops_every_process_says_what_was_kept_and_the_same_command_resumes(tmp_path):
    command = [sys.executable, "-m", "flows.app.run", "run", "--preset", "tiny", "--images", "40",
               "--web-port", str(free_port())]
    started_ms = int(time.time() * 1000)
    first = Terminal(command, tmp_path / "home", tmp_path / "first.log")
    first.wait_for("Task run 'render' - Finished in state Completed", timeout_s=600)
    deadline = time.monotonic() + 300
    while not list((tmp_path / "home" / "runs" / "tiny").glob("pretrain-syn-*/ray/*/checkpoint_*")):  # Ray trains
        assert first.process.poll() is None and time.monotonic() < deadline, first.output()
        time.sleep(0.5)
    first.ctrl_c()
    output = first.output()
    assert first.process.returncode == 130
    stopped = [line for line in output.splitlines() if "make run: stopped." in line]
    assert len(stopped) == 1 and "render finished" in stopped[0] and "pretrain-syn" in stopped[0], output
    assert "run the same command again" in stopped[0]
    assert "Traceback" not in output and output.rstrip().endswith(stopped[0]), output
    assert _mlflow_statuses(started_ms) == {"KILLED"}, "the stopped flow's MLflow runs are not all marked KILLED"

    again = Terminal(command, tmp_path / "home", tmp_path / "again.log")
    again.wait_for("Task run 'render' - Finished in state Cached", timeout_s=300)
    assert "size: " in again.output() and "render done" in again.output()
    again.ctrl_c()
    assert again.process.returncode == 130 and "Traceback" not in again.output()


def _mlflow_statuses(since_ms: int) -> set[str]:
    """The statuses of the MLflow runs that were open when the command was stopped (started since ``since_ms``; the
    command's store is the test session's, inherited through ``MLFLOW_TRACKING_URI``), finished ones left out."""
    from tasks.runtime import tracking

    runs = tracking.client().search_runs([tracking.experiment_id()],
                                         filter_string=f"attributes.start_time >= {since_ms}")
    return {run.info.status for run in runs if run.info.status != "FINISHED"}


def test_ctrl_c_on_vip_render_stops_its_renderers_and_names_the_shards_kept(tmp_path):
    output = tmp_path / "shards"
    render = Terminal([sys.executable, "-m", "tasks.cli", "render", "--preset", "tiny", "--num-images", "100000",
                       "--samples-per-shard", "16", "--workers", "2", "--output", str(output)],
                      tmp_path / "home", tmp_path / "render.log")
    deadline = time.monotonic() + 300
    while not list(output.glob("*.tar")):
        assert render.process.poll() is None and time.monotonic() < deadline, render.output()
        time.sleep(0.5)
    render.ctrl_c()
    text = render.output()
    assert render.process.returncode == 130, text
    assert f"vip render: stopped. Kept in {output}: " in text and " shards." in text, text
    assert "Traceback" not in text and "Warning" not in text, text


def test_a_kill_9_of_a_make_target_also_cancels_its_flow_run_and_stops_its_temporary_prefect_server(tmp_path):
    """``kill -9`` of ``make render``'s process, which started the temporary Prefect server: the flow's own process
    stops the rendering, marks the flow run Cancelled on that server and stops it; nothing of the command is left."""
    prefect_home = tmp_path / "prefect"
    command = [sys.executable, "-m", "flows.app.run", "render", "--yes", "--set", "data.render.num_images=100000",
               "--set", "data.render.samples_per_shard=16"]
    render = Terminal(command, tmp_path / "home", tmp_path / "render.log",
                      env={"PREFECT_API_URL": "", "PREFECT_HOME": str(prefect_home)})
    deadline = time.monotonic() + 300
    while not list((tmp_path / "home" / "runs" / "tiny").glob("render-*/*.tar")):
        assert render.process.poll() is None and time.monotonic() < deadline, render.output()
        time.sleep(0.5)
    os.kill(render.process.pid, signal.SIGKILL)
    render.wait_until_gone()
    with contextlib.closing(sqlite3.connect(prefect_home / "prefect.db")) as database:
        runs = database.execute("SELECT state_type, state_name FROM flow_run").fetchall()
    assert runs == [("CANCELLED", "Cancelled")], render.output()[-3000:]


@pytest.mark.skipif(Devices.here().gpus > 0, reason="the confirmation is for machines without a GPU")
def test_make_run_of_a_paper_preset_without_a_gpu_stops_at_the_confirmation(tmp_path):
    """``make run PRESET=vip-base`` (with the test's interpreter, the environment as it is) asks, and with no
    terminal to answer stops in one line naming YES=1; nothing is started."""
    result = subprocess.run(["make", "-s", "-o", "setup", "run", "PRESET=vip-base", f"PY={sys.executable}"],
                            cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
                            env={**os.environ, "VIP_HOME": str(tmp_path / "home")})
    assert result.returncode != 0
    assert "size: render 1,050,000 images at 256 px" in result.stdout
    refusal = [line for line in result.stderr.splitlines() if "not started" in line]
    assert len(refusal) == 1 and "YES=1" in refusal[0] and "--yes" in refusal[0], result.stderr
    assert not (tmp_path / "home" / "runs").exists()


@pytest.mark.skipif(Devices.here().gpus > 0, reason="the confirmation is for machines without a GPU")
@pytest.mark.parametrize("answer, started", [("n", False), ("y", True), (None, False)], ids=["n", "y", "ctrl-c"])
def test_at_a_terminal_a_paper_preset_asks_and_the_answer_decides(tmp_path, answer, started):
    """The question on a terminal (a pseudo-terminal here); "y" starts the run (stopped by the test as soon as it
    names its Prefect server), anything else does not, and Ctrl-C at the question stops the command. The command
    starts with SIGINT ignored, as a non-interactive shell's background job (a CI script's) leaves it: at a terminal
    Ctrl-C must still stop it."""
    import pty

    controller, terminal = pty.openpty()
    marker = uuid.uuid4().hex
    process = subprocess.Popen([sys.executable, "-m", "flows.app.run", "run", "--preset", "vip-base"], cwd=ROOT,
                               stdin=terminal, stdout=terminal, stderr=terminal, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
                               env={**os.environ, "VIP_HOME": str(tmp_path / "home"), "PREFECT_API_URL": "",
                                    "VIP_TEST_MARKER": marker})
    os.close(terminal)
    try:
        shown = _read_until(controller, "Start it anyway? [y/N]")
        assert "size: render 1,050,000 images" in shown, shown
        if answer is None:
            os.killpg(process.pid, signal.SIGINT)
        else:
            os.write(controller, f"{answer}\n".encode())
        shown = _read_until(controller, "Prefect" if started else "not started")
        if started:
            os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=60) == (2 if answer == "n" else 130), shown
        assert "Traceback" not in shown, shown
        assert _left_running(marker) == [], shown  # the temporary Prefect server too
    finally:
        _kill_tree(process.pid)
        os.close(controller)


def _left_running(marker: str, session: int | None = None) -> list[str]:
    """The processes still running with ``marker`` in their environment (a command's, in any session) or in
    ``session``."""
    found = []
    for process in psutil.process_iter(["pid", "name"]):
        try:
            if ((process.environ().get("VIP_TEST_MARKER") == marker or os.getsid(process.pid) == session)
                    and process.status() != psutil.STATUS_ZOMBIE):
                found.append(f"{process.pid} {process.info['name']}")
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def _kill_tree(pid: int) -> None:
    """Kills a command and everything it started, in any session (a test that failed must not leave a run going)."""
    try:
        root = psutil.Process(pid)
        processes = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=10)


def _read_until(controller: int, text: str, timeout_s: float = 120.0) -> str:
    import select

    shown, deadline = b"", time.monotonic() + timeout_s
    while text.encode() not in shown:
        assert time.monotonic() < deadline, shown.decode(errors="replace")
        if select.select([controller], [], [], 1.0)[0]:
            try:
                shown += os.read(controller, 4096)
            except OSError:  # the terminal closed: the command exited
                break
    assert text.encode() in shown, shown.decode(errors="replace")
    return shown.decode(errors="replace")


@pytest.mark.slow
def test_ctrl_c_on_vip_pretrain_stops_ray_and_resume_goes_on_from_its_last_checkpoint(tmp_path):
    import json

    shards, output = _noise_shards(tmp_path / "shards", 96), tmp_path / "pretrain"
    command = [sys.executable, "-m", "tasks.cli", "pretrain", "--stage", "synthetic", "--preset", "tiny", "--data",
               str(shards), "--output", str(output), "--steps", "40", "--batch-size", "32", "--checkpoint-every", "2"]
    started_ms = int(time.time() * 1000)
    first = Terminal(command, tmp_path / "home", tmp_path / "first.log")
    deadline = time.monotonic() + 300
    while not list(output.glob("ray/*/checkpoint_*")):
        assert first.process.poll() is None and time.monotonic() < deadline, first.output()
        time.sleep(0.5)
    first.ctrl_c()
    text = first.output()
    assert first.process.returncode == 130 and "Traceback" not in text, text
    assert f"vip pretrain: stopped. Kept in {output}: " in text and " checkpoints. To resume: " in text, text
    assert "--resume" in text.splitlines()[-1]
    assert _mlflow_statuses(started_ms) == {"KILLED"}, "the stopped stage's MLflow run is not marked KILLED"

    resumed = subprocess.run([*command, "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "VIP_HOME": str(tmp_path / "home")})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert result["steps"] == 40 and result["resumes"] >= 1, result


def _noise_shards(folder: Path, count: int) -> Path:
    """``count`` random 32 px PNG images in webdataset shards of 32."""
    import numpy as np
    from PIL import Image

    from vip_core.data.shards import ShardWriter, encode_image

    with ShardWriter(folder, prefix="img", samples_per_shard=32) as writer:
        for index in range(count):
            pixels = np.random.default_rng(index).integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
            writer.write(f"{index:05d}", {"png": encode_image(Image.fromarray(pixels), "png")})
    return folder
