"""``make run``: the whole pipeline on one machine, from nothing, with everything it needs made locally.

1. A small web of photographs is served on 127.0.0.1 (``tasks.fixtures.web``) and a LAION-style url list of it
   is written: the ingestion stage downloads it through img2dataset as it would download LAION.
2. Small public evaluation sets are made offline (``tasks.fixtures.eval_sets``): digits in ImageFolder layout,
   shapes in COCO and ADE20K layouts.
3. The Prefect flow ``vip-pipeline`` runs on the preset (local Prefect, local Ray, the sqlite MLflow store
   under ``$VIP_HOME``): ingest and render, pre-training on synthetic images, private pre-training, and
   every evaluation job beside its random-init baseline.
4. The results table is printed (ε spent, each evaluation beside its baseline) with the URLs to look at.

Running it again reuses the data already made and skips the stages already done with the same config.
The web sample is served on a fixed port (``--web-port``), so the url list stays the same from one run to
the next and the ingestion stage stays cached.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from vip_core.config import VipConfig, get_preset
from tasks.runtime.environment import configure_environment

WEB_PORT = 8765
WEB_IMAGES = 320
SHAPE_SCENES = 160
PROGRESS_LOGGERS = "tasks,vip_core,flows"


def make_eval_data(root: Path, img_size: int, scenes: int = SHAPE_SCENES) -> Path:
    """The three evaluation sets below ``root`` (``classification/``, ``coco/``, ``ade20k/``), made once."""
    from tasks.fixtures.eval_sets import make_ade20k_shapes, make_coco_shapes, make_digits_imagefolder

    builders = {
        "classification": lambda folder: make_digits_imagefolder(folder, img_size),
        "coco": lambda folder: make_coco_shapes(folder, img_size, scenes),
        "ade20k": lambda folder: make_ade20k_shapes(folder, img_size, scenes),
    }
    for name, build in builders.items():
        folder, done = root / name, root / f".{name}.done"
        if not done.exists():
            build(folder)
            done.touch()
    return root


def make_url_list(path: Path, base_url: str, images: int) -> Path:
    """The url list of the sample web, written once (it names the fixed port, so it stays valid)."""
    from tasks.fixtures.web import write_sample_url_list

    if not path.exists():
        partial = path.with_name(f"partial-{path.name}")
        write_sample_url_list(partial, base_url, images)
        partial.replace(path)
    return path


@contextlib.contextmanager
def sample_web(root: Path, port: int) -> Iterator[str]:
    """Serves the sample web on 127.0.0.1:``port`` for the block; yields its base URL."""
    from tasks.fixtures.web import serve_sample_web

    try:
        base_url, stop_web = serve_sample_web(root, port=port)
    except OSError as error:
        raise OSError(f"web port {port} is taken ({error.strerror}); pass --web-port with a free one") from None
    try:
        yield base_url
    finally:
        stop_web()


class TrainingProgress:
    """Prints the step, loss and ε of each training stage that is running, read from MLflow every few seconds.

    The training workers run in Ray's processes; their metrics reach MLflow at every step, so the store is
    where the driver sees them.
    """

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self.since_ms = int(time.time() * 1000)
        self._printed: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "TrainingProgress":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(Exception):  # a busy store is no reason to stop the run: next time
                self.report()

    def report(self) -> None:
        from tasks.runtime import tracking

        client = tracking.client()
        running = client.search_runs(
            [tracking.experiment_id()],
            filter_string=f"attributes.status = 'RUNNING' AND attributes.start_time >= {self.since_ms}",
        )
        for run in running:
            stage = run.data.tags.get(tracking.STAGE_TAG, "")
            if "train/loss" not in run.data.metrics:
                continue
            step = client.get_metric_history(run.info.run_id, "train/loss")[-1].step
            total = run.data.params.get("private.steps" if stage == "pretrain-dp" else "synthetic.steps", "?")
            line = f"[progress] {stage}: step {step}/{total}, train/loss {run.data.metrics['train/loss']:.4f}"
            if "privacy/epsilon" in run.data.metrics:
                line += f", privacy/epsilon {run.data.metrics['privacy/epsilon']:.3f}"
            if self._printed.get(run.info.run_id) != line:
                self._printed[run.info.run_id] = line
                _say(line)


def use_running_prefect_server() -> str | None:
    """Points Prefect at ``make ui``'s server when it runs (the run then shows live); else None.

    Without it, Prefect starts a temporary server on the same database, and ``make ui`` shows the run later.
    """
    from flows.app.servers import is_healthy, prefect_health_url, prefect_url

    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    if is_healthy(prefect_health_url()):
        os.environ["PREFECT_API_URL"] = f"{prefect_url()}/api"
        return os.environ["PREFECT_API_URL"]
    return None


def run_demo(config: VipConfig, *, web_port: int = WEB_PORT, images: int = WEB_IMAGES) -> dict:
    """Makes the inputs, serves the web sample, runs the pipeline flow; returns its summary."""
    home = configure_environment()
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", PROGRESS_LOGGERS)
    # The temporary server creates its database on the first run: more than Prefect's 20 s on a busy machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "300")
    demo = home / "demo"
    _say(f"[demo] evaluation data (public, offline) in {demo / 'eval'}")
    eval_data = make_eval_data(demo / "eval", config.model.img_size)
    with sample_web(demo / "web", web_port) as base_url:
        url_list = make_url_list(demo / f"urls-{web_port}.parquet", base_url, images)
        _say(f"[demo] web sample served at {base_url}; url list {url_list}")
        from flows.pipeline import vip_pipeline

        with TrainingProgress():
            return vip_pipeline(config=config, url_list=str(url_list), eval_data=str(eval_data))


def report(summary: dict, seconds: float) -> str:
    """The results table and where to look next."""
    from tasks.runtime import results, tracking
    from flows.app.servers import prefect_url

    prefect_base = os.environ.get("PREFECT_API_URL", f"{prefect_url()}/api").removesuffix("/api")
    lines = [
        "",
        results.text_table(summary),
        "",
        f"  finished in {seconds / 60:.1f} min",
        "",
        "Where to look (start the servers with `make ui` if they are not running):",
        f"  Prefect flow run: {prefect_base}/runs/flow-run/{summary['flow_run_id']}",
        f"  MLflow run:       {tracking.run_ui_url(summary['mlflow_run_id'])}",
        f"  MLflow model:     {tracking.ui_base_url()}/#/models/{summary['registered_model'].split('/')[0]}",
        f"  files:            {summary['workdir']}",
        "",
        "The (ε, δ) guarantee covers the private pre-training data only; evaluation data is public.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.app.run", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="the config preset (default: tiny)")
    parser.add_argument("--web-port", type=int, default=WEB_PORT, help="the sample web's port on 127.0.0.1")
    parser.add_argument("--images", type=int, default=WEB_IMAGES, help="photographs in the sample web")
    args = parser.parse_args(argv)
    configure_environment()
    try:
        config = get_preset(args.preset)
    except ValueError as error:
        print(f"make run: error: {error}", file=sys.stderr)
        return 2
    server = use_running_prefect_server()
    _say(f"[demo] preset {config.name}; Prefect API: {server or 'a temporary local server'}; "
         f"MLflow: {os.environ['MLFLOW_TRACKING_URI']}")
    started = time.perf_counter()
    summary = run_demo(config, web_port=args.web_port, images=args.images)
    print(report(summary, time.perf_counter() - started), flush=True)
    return 0


def _say(message: str) -> None:
    print(message, flush=True)


if __name__ == "__main__":
    sys.exit(main())
