"""``make run`` and ``make <stage>``: a flow of the pipeline on one machine, with everything it needs made locally.

1. The inputs, unless given: small public evaluation sets made offline (``tasks.fixtures.eval_sets``:
   digits in ImageFolder layout, shapes in COCO and ADE20K layouts), and a small web of photographs served
   on 127.0.0.1 (``tasks.fixtures.web``) with a LAION-style url list of it, which the ingestion stage
   downloads through img2dataset as it would download LAION.
2. The target's flow (``flows/targets.py``: ``vip-pipeline`` for ``make run``, the stage's own flow for
   ``make <stage>``) on local Prefect (``make ui``'s server when it runs, else a temporary one on the same
   database), a local Ray and the sqlite MLflow store under ``$VIP_HOME``; the training stages print their
   step, loss and ε as they go.
3. The state of each stage (Completed, Cached) and, for ``make run``, the results table and where to look.

Before the flow starts, one line sizes its work (:mod:`tasks.runtime.sizing`); a run far beyond a CPU demo on a
machine without a GPU asks for confirmation (``--yes``, ``make ... YES=1``). The flow runs supervised
(:mod:`tasks.runtime.stopping`): Ctrl-C stops it and everything it started within seconds, then the temporary
Prefect server, and one line says what was kept and how to resume.

Every target names its stages' folders and cache keys as the pipeline does, so what one target did is
Cached in the others. The sample web is served on a fixed port (``--web-port``), so the url list, and with
it the ingestion stage, stays the same from one run to the next.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from flows.app.servers import cancel_flow_run, stop_noted
from tasks.cli.options import add_config_sources, config_from
from tasks.runtime.environment import configure_environment, state_paths
from tasks.runtime.folders import RESULT_FILE
from tasks.runtime.names import STAGES
from tasks.runtime.sizing import confirm, size_run, url_list_rows
from tasks.runtime.stopping import (
    INTERRUPTED, hear_ctrl_c, is_supervised, kept_work, run_supervised, stop_with_supervisor,
)
from vip_core.config import ConfigError, VipConfig

TARGETS = ("run", *STAGES)
PIPELINE_STAGES = ("ingest", "render", "pretrain-syn", "pretrain-dp")
# The training-side stages each target's flow runs (unless finished): its own and those it reads.
TARGET_STAGES = {"run": PIPELINE_STAGES, "ingest": ("ingest",), "render": ("render",),
                 "pretrain-syn": ("render", "pretrain-syn"), "pretrain-dp": PIPELINE_STAGES, "eval": PIPELINE_STAGES,
                 "audit": ()}
EVALUATING_TARGETS = ("run", "eval")
FLOW_RUN_FILE_ENV = "VIP_FLOW_RUN_FILE"
TEMPORARY_SERVER_ENV = "VIP_TEMPORARY_PREFECT_SERVER"  # the temporary server's note (flows.app.servers.noted)
STOPPED_MESSAGE = "stopped (Ctrl-C); the same command resumes it"
KILLED_MESSAGE = "stopped (its command was killed); the same command resumes it"
WEB_PORT = 8765
WEB_IMAGES = 320
SHAPE_SCENES = 160
PROGRESS_LOGGERS = "tasks,vip_core,flows"


@contextlib.contextmanager
def flow_inputs(config: VipConfig, wanted: set[str], *, url_list: str = "", eval_data: str = "",
                image_folder: str = "", web_port: int = WEB_PORT, images: int = WEB_IMAGES) -> Iterator[dict[str, str]]:
    """The inputs a flow takes (``wanted`` of ``url_list``, ``eval_data``, ``image_folder``): the given ones, else
    the demo's.

    The demo's evaluation sets are made once under ``$VIP_HOME/demo/eval``; its sample web is served for the
    block, and its url list written once, only when the flow reads a url list and neither one nor an image folder
    is given.
    """
    demo = demo_inputs(web_port)
    inputs = {"image_folder": image_folder} if image_folder else {}
    if "eval_data" in wanted:
        inputs["eval_data"] = eval_data or _demo_eval_data(Path(demo["eval_data"]), config.model.img_size)
    if "url_list" not in wanted or url_list or image_folder:
        yield {**inputs, **({"url_list": url_list} if url_list else {})}
        return
    from tasks.fixtures.web import serving, write_sample_url_list

    with serving(Path(demo["web"]), web_port) as base_url:
        path = Path(demo["url_list"])
        if not path.exists():
            write_sample_url_list(path, base_url, images)
        say(f"web sample served at {base_url}; url list {path}")
        yield {**inputs, "url_list": str(path)}


def demo_inputs(web_port: int = WEB_PORT) -> dict[str, str]:
    """Where the demo's inputs live under ``$VIP_HOME/demo``: ``eval_data``, ``url_list`` (of the sample web on
    ``web_port``) and ``web`` (its photographs)."""
    demo = state_paths()["home"] / "demo"
    return {"eval_data": str(demo / "eval"), "url_list": str(demo / f"urls-{web_port}.parquet"),
            "web": str(demo / "web")}


def run_target(target: str, config: VipConfig, **options: Any) -> Any:
    """Runs the flow of make target ``target`` on ``config``; returns its final Prefect state.

    Args:
        target: ``run`` or a stage name.
        config: the run's configuration.
        options: the flow's other parameters (``checkpoint``, ``audit_canaries``, ...) and :func:`flow_inputs`'
            options (``url_list``, ``eval_data``, ``image_folder``, ``web_port``, ``images``); each flow takes those
            it declares.
    """
    from flows.app.progress import TrainingProgress
    from flows.targets import FLOWS

    flow = noting_flow_run(FLOWS[target])
    accepted = set(inspect.signature(flow.fn).parameters)
    input_options = {key: options.pop(key) for key in ("url_list", "eval_data", "image_folder", "web_port", "images")
                     if key in options}
    with flow_inputs(config, accepted, **input_options) as inputs, TrainingProgress():
        parameters = {key: value for key, value in {**options, **inputs}.items() if key in accepted and value != ""}
        return flow(config=config, **parameters, return_state=True)


def stage_states(flow_state: Any) -> list[tuple[str, str]]:
    """``(task run name, state name)`` of every task run of the flow run, in the order they started."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id])),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC)
    return [(run.name, run.state.name) for run in runs]


def report(target: str, flow_state: Any, seconds: float) -> str:
    """What a person reads at the end: each stage's state, then the results table (``make run``) or the
    stage's result, and where to look."""
    from flows.app.servers import prefect_url
    from tasks.runtime import results

    states = stage_states(flow_state)
    width = max(len(name) for name, _ in states) if states else 0
    lines = ["", f"make {target}: {flow_state.name} in {seconds / 60:.1f} min", "",
             *(f"  {name.ljust(width)}  {state}" for name, state in states), ""]
    result = flow_state.result() if flow_state.is_completed() else None
    if result is None:
        lines += [f"  {flow_state.message}", ""]
    elif target == "run":
        lines += [results.text_table(result), ""]
    elif target == "eval":
        lines += [*results.evaluation_table(result), ""]
    else:
        lines += [f"  {target}: {results.one_line(result)}", ""]
    prefect_base = (os.environ.get("PREFECT_UI_URL")
                    or os.environ.get("PREFECT_API_URL", f"{prefect_url()}/api").removesuffix("/api"))
    lines += ["Where to look (start the servers with `make ui` if they are not running):",
              f"  Prefect flow run: {prefect_base}/runs/flow-run/{flow_state.state_details.flow_run_id}"]
    if target == "run" and result is not None:
        lines += _mlflow_links(result)
    lines += ["", "The (ε, δ) guarantee covers the private pre-training data only; evaluation data is public."]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.app.run", description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=TARGETS, help="run: the whole pipeline; a stage: its own flow")
    parser.add_argument("--preset", default="tiny", help="the config preset (default: tiny)")
    add_config_sources(parser)
    parser.add_argument("--url-list", default="", help="a LAION-format url list (default: the sample web's)")
    parser.add_argument("--input", default="", help="a folder or fsspec URL of image files, read instead of a url list")
    parser.add_argument("--eval-data", default="", help="the evaluation sets' folder or fsspec URL (default: the offline ones)")
    parser.add_argument("--checkpoint", default="", help="eval: this checkpoint instead of the pipeline's encoder")
    parser.add_argument("--eval-tasks", default="", help="eval: these tasks (space-separated) instead of the preset's")
    parser.add_argument("--web-port", type=int, default=WEB_PORT, help="the sample web's port on 127.0.0.1")
    parser.add_argument("--images", type=int, default=WEB_IMAGES, help="photographs in the sample web")
    parser.add_argument("--yes", action="store_true",
                        help="start a run far beyond a CPU demo without a GPU without asking (make: YES=1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    configure_environment()
    try:
        config = target_config(args)
    except ValueError as error:
        print(f"make {args.target}: error: {error}", file=sys.stderr)
        return 2
    if is_supervised():
        stop_flow_with_supervisor()
        return run_here(args, config)
    return supervise(args, config, argv)


def supervise(args: argparse.Namespace, config: VipConfig, argv: list[str]) -> int:
    """The size line, the confirmation, then the flow in a supervised child (:mod:`tasks.runtime.stopping`)
    served by a Prefect server that outlives it; returns the exit status."""
    hear_ctrl_c()
    folders = target_folders(args, config)
    size = size_run(config, tuple(folders), ingest_rows=_ingest_rows(args),
                    done={stage for stage, folder in folders.items() if is_finished(folder)},
                    evaluation=args.target in EVALUATING_TARGETS)
    say(size.line())
    try:
        refusal = confirm(size, yes=args.yes, flag="--yes (make: YES=1)")
    except KeyboardInterrupt:  # Ctrl-C at the question
        print(f"\nmake {args.target}: not started", file=sys.stderr)
        return INTERRUPTED
    if refusal:
        print(f"make {args.target}: {refusal}", file=sys.stderr)
        return 2
    return run_flow_supervised(f"make {args.target}", ["flows.app.run", *argv], lambda: kept_line(args.target, folders))


def run_flow_supervised(name: str, module_argv: list[str], kept: Callable[[], str]) -> int:
    """``python -m *module_argv`` (a command that runs a flow) in a supervised child (:mod:`tasks.runtime.stopping`),
    served by a Prefect server that outlives it; returns the exit status.

    When stopped, the flow run (noted by :func:`noting_flow_run`) and its open task runs are marked Cancelled while
    the server still runs, and ``kept()`` is the line printed.
    """
    hear_ctrl_c()
    notes = tempfile.TemporaryDirectory(prefix="vip-flow-run-")
    flow_run_file = Path(notes.name) / "id"
    os.environ[FLOW_RUN_FILE_ENV] = str(flow_run_file)

    def stopped() -> str:
        _cancel_noted_flow_run(flow_run_file, STOPPED_MESSAGE)
        return kept()

    try:
        with notes, prefect_server_for_run() as server_pids:
            return run_supervised([sys.executable, "-m", *module_argv], stopped=stopped, spare=server_pids)
    except KeyboardInterrupt:  # while the Prefect server was starting: nothing was done
        print(f"\n[vip] {name}: stopped before the flow started; nothing was done", flush=True)
        return INTERRUPTED


def stop_flow_with_supervisor() -> None:
    """In the child of :func:`run_flow_supervised`: :func:`~tasks.runtime.stopping.stop_with_supervisor`, and once a
    SIGKILL took the supervisor, what it would have done after the child too: the flow run marked Cancelled, the
    temporary Prefect server stopped."""
    stop_with_supervisor(after_work=_end_flow_run_and_server)


def _end_flow_run_and_server() -> None:
    if os.environ.get(FLOW_RUN_FILE_ENV):
        flow_run_file = Path(os.environ[FLOW_RUN_FILE_ENV])
        _cancel_noted_flow_run(flow_run_file, KILLED_MESSAGE)
        shutil.rmtree(flow_run_file.parent, ignore_errors=True)  # the supervisor's notes folder
    if os.environ.get(TEMPORARY_SERVER_ENV):
        stop_noted(os.environ[TEMPORARY_SERVER_ENV])


def _cancel_noted_flow_run(flow_run_file: Path, message: str) -> None:
    """Marks the flow run noted in ``flow_run_file`` (:func:`noting_flow_run`), if it started, Cancelled."""
    if flow_run_file.is_file() and os.environ.get("PREFECT_API_URL"):
        cancel_flow_run(os.environ["PREFECT_API_URL"], flow_run_file.read_text(), message)


def run_here(args: argparse.Namespace, config: VipConfig) -> int:
    """The flow of ``args.target`` in this process, then the report; returns the exit status."""
    prepare_console()
    started = time.perf_counter()
    state = run_target(args.target, config, url_list=args.url_list, eval_data=args.eval_data,
                       image_folder=args.input, checkpoint=args.checkpoint, web_port=args.web_port, images=args.images)
    print(report(args.target, state, time.perf_counter() - started), flush=True)
    return 0 if state.is_completed() else 1


def target_folders(args: argparse.Namespace, config: VipConfig) -> dict[str, str]:
    """The folders of the training-side stages that ``args.target``'s flow runs (each unless finished), by stage:
    what its run is sized by and what it keeps when stopped. Empty where an input URL lists no file (the flow
    then says so)."""
    from flows.caching import default_workdir, stage_folders

    stages = () if args.target == "eval" and args.checkpoint else TARGET_STAGES[args.target]
    demo = demo_inputs(args.web_port)
    try:
        folders = stage_folders(config, default_workdir(config), args.url_list or demo["url_list"],
                                args.eval_data or demo["eval_data"], image_folder=args.input)
    except FileNotFoundError:
        return {}
    return {stage: folders[stage] for stage in stages}


def kept_line(target: str, folders: dict[str, str]) -> str:
    """The line said when a run is stopped: what its stages kept and how to resume."""
    finished = [stage for stage, folder in folders.items() if is_finished(folder)]
    partial = [f"{stage} {kept_work(folder)}" for stage, folder in folders.items()
               if stage not in finished and kept_work(folder)]
    kept = "; ".join(([f"{', '.join(finished)} finished"] if finished else []) + partial) or "no finished work"
    where = f" in {Path(next(iter(folders.values()))).parent}" if folders else ""
    return (f"[vip] make {target}: stopped. Kept{where}: {kept}. To resume, run the same command again: finished "
            "stages are Cached, pre-training goes on from its last checkpoint, complete shards are kept.")


def is_finished(folder: str) -> bool:
    """True when a stage's folder holds its final record: ``stats.json`` (ingest, render: written last) or
    ``result.json`` (pre-training)."""
    return any((Path(folder) / name).is_file() for name in (RESULT_FILE, "stats.json"))


@contextlib.contextmanager
def prefect_server_for_run() -> Iterator[list[int]]:
    """``make ui``'s Prefect server (or ``PREFECT_API_URL``'s) when it runs, else a temporary one on the same
    database in a session of its own, stopped after the flow; yields the process ids to spare while stopping."""
    from flows.app.servers import (
        free_port, noted, prefect_url, start_prefect_server, stop, use_running_prefect_server,
    )

    if use_running_prefect_server():
        yield []
        return
    server = start_prefect_server(port=free_port())
    try:  # from here on: a Ctrl-C while the line below is said must not leave the server behind
        os.environ["PREFECT_API_URL"] = f"{server.url}/api"
        os.environ[TEMPORARY_SERVER_ENV] = noted(server)  # for the flow's process, should this one be killed
        os.environ.setdefault("PREFECT_UI_URL", prefect_url())  # links to the run: make ui's server, which shows it
        say(f"a temporary Prefect server at {server.url}, stopped after the flow")
        yield [server.process.pid]
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the flow is over: a Ctrl-C now does not cut this stop short
        stop(server)


def noting_flow_run(flow: Any) -> Any:
    """The flow, which under :func:`run_flow_supervised` writes its flow run's id where the supervisor looks."""
    return flow.with_options(on_running=[_note_flow_run]) if os.environ.get(FLOW_RUN_FILE_ENV) else flow


def _note_flow_run(flow: Any, flow_run: Any, state: Any) -> None:
    """Writes the flow run's id where the supervisor looks for it, to mark the run Cancelled when stopped."""
    Path(os.environ[FLOW_RUN_FILE_ENV]).write_text(str(flow_run.id))


def prepare_console() -> None:
    """Prefect on the terminal: ``make ui``'s server when it runs, the project's own loggers shown, and time for
    a temporary server to create its database on a busy machine (more than Prefect's 20 s)."""
    from flows.app.servers import use_running_prefect_server

    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", PROGRESS_LOGGERS)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "300")
    show_setting_errors_in_one_line()
    server = use_running_prefect_server()
    say(f"Prefect API: {server or 'a temporary local server'}; MLflow: {os.environ['MLFLOW_TRACKING_URI']}")


# Prefect's loggers of a flow's and a task's run: where a failed stage's exception is logged with its traceback.
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class SettingErrorsInOneLine(logging.Filter):
    """Drops the traceback of a :class:`ConfigError` (a setting that cannot work, such as a spent privacy budget):
    its message names the setting and is the whole story; any other error keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], ConfigError):
            record.exc_info, record.exc_text = None, None
        return True


def show_setting_errors_in_one_line() -> None:
    """Installs :class:`SettingErrorsInOneLine` on Prefect's run loggers (once)."""
    for name in RUN_LOGGERS:
        if not any(isinstance(f, SettingErrorsInOneLine) for f in logging.getLogger(name).filters):
            logging.getLogger(name).addFilter(SettingErrorsInOneLine())


def say(message: str) -> None:
    """A line for the person at the terminal."""
    print(f"[vip] {message}", flush=True)


def target_config(args: argparse.Namespace) -> VipConfig:
    """The flow's config: the preset, ``CONFIG=``'s file, ``EVAL_TASKS=``, then ``SET=``'s settings."""
    return config_from(args, overrides={"evaluation.tasks": args.eval_tasks.split()} if args.eval_tasks else None)


def _ingest_rows(args: argparse.Namespace) -> int | None:
    """The url list's rows or the sample web's photographs; None for an image folder (ingestion counts its files)."""
    if args.input:
        return None
    return url_list_rows(args.url_list) if args.url_list else args.images


def _demo_eval_data(root: Path, img_size: int) -> str:
    from tasks.fixtures.eval_sets import make_eval_sets

    made = make_eval_sets(root, img_size, SHAPE_SCENES)
    say(f"evaluation data (public, offline) in {root}" + (" (made now)" if any(s["made"] for s in made.values()) else ""))
    return str(root)


def _mlflow_links(summary: dict) -> list[str]:
    from tasks.runtime import tracking

    return [f"  MLflow run:       {tracking.run_ui_url(summary['mlflow_run_id'])}",
            f"  MLflow runs:      {tracking.experiment_ui_url()}",
            f"  MLflow model:     {tracking.model_ui_url(*summary['registered_model'].split('/'))}",
            f"  files:            {summary['workdir']}"]


if __name__ == "__main__":
    sys.exit(main())
