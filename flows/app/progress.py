"""Training progress for a person at the terminal: step, loss and ε of the training stages that are running."""

from __future__ import annotations

import contextlib
import threading
import time


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
            # train/lr is logged at every step of every stage; the private stage's loss only when
            # privacy.log_private_statistics is on.
            if "train/lr" not in run.data.metrics:
                continue
            step = client.get_metric_history(run.info.run_id, "train/lr")[-1].step
            total = run.data.params.get("private.steps" if stage == "pretrain-dp" else "synthetic.steps", "?")
            line = f"[progress] {stage}: step {step}/{total}"
            if "train/loss" in run.data.metrics:
                line += f", train/loss {run.data.metrics['train/loss']:.4f}"
            if "privacy/epsilon" in run.data.metrics:
                line += f", privacy/epsilon {run.data.metrics['privacy/epsilon']:.3f}"
            if self._printed.get(run.info.run_id) != line:
                self._printed[run.info.run_id] = line
                print(line, flush=True)
