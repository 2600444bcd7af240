"""Ctrl-C for a long command: its work runs in a child process of its own process group, and this process stops
everything the child started.

A terminal's Ctrl-C sends SIGINT to its foreground process group. Left alone, each process of a run hears it on
its own: a spawned renderer or img2dataset prints a traceback, a Prefect server dies under the flow it serves,
and the flow's threads go on; a Ray driver even leaves the group (Ray makes it a group leader). So the command
runs supervised (:func:`run_supervised`): the work in a child in a new process group, which the terminal's
signals do not reach, and this process, still in the terminal's group, as a child subreaper (orphaned
descendants become its children). On SIGINT, SIGTERM or SIGHUP it kills the child's group and every other
descendant (:func:`stop_descendants`) but the processes it was asked to spare (a Prefect server the caller stops
after the flow), marks the MLflow runs the command opened and left open KILLED (FAILED where the child died on its
own), prints one line and returns :data:`INTERRUPTED`. A SIGKILL of this process cannot be caught: the child
(:func:`stop_with_supervisor`) sees it gone and stops what it started, then what the supervisor would have stopped
after it, then itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import psutil

SUPERVISED_ENV = "VIP_SUPERVISED"
OPENED_RUNS_ENV = "VIP_OPENED_RUNS"  # the file where the child's processes note each MLflow run they open
INTERRUPTED = 130  # a shell's exit status for a command stopped by SIGINT
WAIT_S = 5.0
SUPERVISOR_POLL_S = 0.5
KILL_ROUNDS = 5
ENDING_RUNS_S = 15.0  # the longest a stop waits for the MLflow store to mark the command's open runs
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_CHILD_SUBREAPER = 36


def is_supervised() -> bool:
    """True in the child of :func:`run_supervised`: the process that does the work."""
    return os.environ.get(SUPERVISED_ENV) == "1"


def hear_ctrl_c() -> None:
    """At a terminal, makes Ctrl-C raise KeyboardInterrupt here also where the shell that started this process left
    SIGINT ignored (as a non-interactive shell does for its background jobs, and the process inherits): the person at
    the terminal expects it to stop the command, before :func:`run_supervised` takes the signal over too."""
    if sys.stdin is not None and sys.stdin.isatty() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run_supervised(command: list[str], *, stopped: Callable[[], str], spare: Iterable[int] = ()) -> int:
    """Runs ``command`` in a new process group and returns its exit status; on SIGINT, SIGTERM or SIGHUP stops it.

    Args:
        command: the child's command line; it sees ``VIP_SUPERVISED=1`` (:func:`is_supervised`) and
            ``VIP_OPENED_RUNS``, where :func:`tasks.runtime.tracking.start_run` notes the runs it opens.
        stopped: the line printed once the child and its descendants are gone (what was kept, how to resume).
        spare: process ids (with their descendants) left running: the caller stops them after the child.

    Returns:
        The child's exit status (128 + the signal that killed it), or :data:`INTERRUPTED` when stopped here.
    """
    _become_subreaper()
    received: list[int] = []
    previous = {number: signal.signal(number, lambda signum, _frame: received.append(signum))
                for number in STOP_SIGNALS}
    notes = tempfile.TemporaryDirectory(prefix="vip-supervised-")
    opened = Path(notes.name) / "mlflow-runs"
    try:
        child = subprocess.Popen(command, env={**os.environ, SUPERVISED_ENV: "1", OPENED_RUNS_ENV: str(opened)},
                                 process_group=0)
        while child.poll() is None and not received:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=0.2)
        for number in STOP_SIGNALS:  # a second Ctrl-C does not cut the stopping short
            signal.signal(number, signal.SIG_IGN)
        stop_descendants(child.pid, spare)  # also what a finished child left running
        child.wait()
        if received or child.returncode:
            _end_opened_runs(opened, "KILLED" if received else "FAILED")
        if not received:
            return child.returncode if child.returncode >= 0 else 128 - child.returncode
        print(stopped(), flush=True)
        return INTERRUPTED
    finally:
        notes.cleanup()
        for number, handler in previous.items():
            signal.signal(number, handler)


def stop_with_supervisor(after_work: Callable[[], None] | None = None) -> None:
    """In the supervised child: once the supervising process is gone (a SIGKILL, which it cannot hear), stops what it
    would have: every process this one started, the MLflow runs the command left open (KILLED), then what the
    supervisor does after its child (``after_work``: a make target's flow run and temporary Prefect server), then
    this one."""
    supervisor = os.getppid()
    _become_subreaper()
    threading.Thread(target=_stop_when_gone, args=(supervisor, after_work), name="vip-supervisor-watch",
                     daemon=True).start()


def _stop_when_gone(supervisor: int, after_work: Callable[[], None] | None) -> None:
    while os.getppid() == supervisor:
        time.sleep(SUPERVISOR_POLL_S)
    silent = os.open(os.devnull, os.O_WRONLY)
    for stream in (1, 2):  # the person who killed the command hears nothing more of it (its dying work's errors)
        os.dup2(silent, stream)
    _kill_descendants(set(), WAIT_S)
    if OPENED_RUNS_ENV in os.environ:
        opened = Path(os.environ[OPENED_RUNS_ENV])
        _end_opened_runs(opened, "KILLED")
        shutil.rmtree(opened.parent, ignore_errors=True)  # the supervisor's notes folder, which it cannot remove now
    if after_work is not None:
        with contextlib.suppress(Exception):  # what it could not do stays as a supervisor's SIGKILL left it
            after_work()
    os.killpg(os.getpgid(0), signal.SIGKILL)


def stop_descendants(work: int, spare: Iterable[int] = (), timeout_s: float = WAIT_S) -> None:
    """Kills the process group of ``work`` and every descendant of this process outside ``spare``'s trees.

    SIGKILL, not SIGTERM: a process told to stop would retry, clean up and print (a flow engine its tasks' errors,
    multiprocessing's resource tracker its warnings), and nothing a run leaves needs that: its pieces are written
    whole (:mod:`vip_core.atomic`), and a rerun clears the partial files. Rounds repeat while a process forked in
    the meantime is found.
    """
    spared = set()
    for pid in spare:
        with contextlib.suppress(psutil.NoSuchProcess):
            spared |= {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(work, signal.SIGKILL)
    _kill_descendants(spared, timeout_s)


def _kill_descendants(spared: set[int], timeout_s: float) -> None:
    for _ in range(KILL_ROUNDS):
        targets = [process for process in _live_descendants() if process.pid not in spared]
        if not targets:
            return
        for process in targets:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(targets, timeout=timeout_s)


def _live_descendants() -> list[psutil.Process]:
    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def _end_opened_runs(opened: Path, status: str) -> None:
    """Ends with ``status`` the MLflow runs noted in ``opened`` that the child's processes left RUNNING, waiting at
    most :data:`ENDING_RUNS_S`: a store out of reach (a tracking server retries for minutes) leaves them RUNNING,
    and the command still stops within seconds."""
    if not opened.is_file():
        return
    run_ids = opened.read_text().split()

    def end() -> None:
        from tasks.runtime import tracking

        with contextlib.suppress(Exception):
            tracking.end_open_runs(run_ids, status)

    ending = threading.Thread(target=end, daemon=True)
    ending.start()
    ending.join(ENDING_RUNS_S)


def kept_work(folder: str | Path) -> str:
    """What a stopped stage left in its folder that a rerun keeps: ``"3 shards, 2 checkpoints"``, or ``""``.

    Complete shards (``*.tar``, each written whole) and Ray Train's checkpoints (``ray/<stage>/checkpoint_*``).
    """
    counts = {"shards": len(list(Path(folder).glob("*.tar"))),
              "checkpoints": len(list(Path(folder).glob("ray/*/checkpoint_*")))}
    return ", ".join(f"{count} {what}" for what, count in counts.items() if count)


def _become_subreaper() -> None:
    """Orphans of the child's tree (a Ray process whose parent died first) become this process's children, so
    :func:`stop_descendants` finds them. Linux only; elsewhere the child's process group is what is stopped."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
