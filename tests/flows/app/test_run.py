"""``make <stage>`` and ``make run`` share their stages: on the code path of the make targets
(:func:`flows.app.run.run_target`), a stage target's work is reused by the pipeline, and after the pipeline
every stage target finds each of its stages Cached and returns the pipeline's results (slow: about 3 min,
two Ray Train runs). The fast test runs ``make ingest`` twice: its inputs (the sample web's url list, the
evaluation sets) stay the same from one make to the next, so the second run is Cached.

Real Prefect (a temporary server), a local Ray, the MLflow store of the session; a micro config of the tiny
preset and a small sample web."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from flows.app.run import RUN_LOGGERS, report, run_target, show_setting_errors_in_one_line, stage_states
from flows.app.servers import free_port
from tasks.runtime.names import STAGES
from vip_core.config import ConfigError, tiny, with_overrides

MICRO = {
    "data.render.num_images": 64,
    "synthetic.steps": 2, "synthetic.batch_size": 32, "synthetic.warmup_steps": 0, "synthetic.checkpoint_every": 2,
    "private.steps": 2, "private.batch_size": 32, "private.warmup_steps": 0, "private.checkpoint_every": 2,
    "evaluation.tasks": ("linprobe",), "evaluation.linprobe_epochs": 1,
}


@pytest.fixture(scope="module")
def make(prefect_api, tmp_path_factory):
    """``make TARGET`` on the micro config, in one work folder; returns the flow run's final state."""
    options = {"workdir": str(tmp_path_factory.mktemp("runs")), "web_port": free_port(), "images": 40,
               "audit_canaries": 50}
    config = with_overrides(tiny(), MICRO)

    def run(target: str):
        state = run_target(target, config, **options)
        assert state.is_completed(), state.message
        return state

    return run


def _states(state) -> dict[str, str]:
    return dict(stage_states(state))


def test_make_ingest_again_is_cached_the_sample_web_and_its_url_list_staying_the_same(make):
    first, again = make("ingest"), make("ingest")
    assert _states(first) == {"ingest": "Completed"} and _states(again) == {"ingest": "Cached"}
    output = again.result()["output"]
    assert output == first.result()["output"] and Path(output).name.startswith("ingest-")


@pytest.mark.slow
def test_make_run_reuses_a_stage_target_and_then_every_stage_target_is_cached(make):
    synthetic = make("pretrain-syn")
    assert set(_states(synthetic).values()) == {"Completed"}

    pipeline = make("run")
    states = _states(pipeline)
    assert [states[name] for name in ("render", "pretrain-syn")] == ["Cached", "Cached"]
    assert states["pretrain-dp"] == states["eval-linprobe"] == states["audit"] == "Completed"
    summary = pipeline.result()
    assert "ViP results" in report("run", pipeline, 60.0)

    for target in STAGES:
        state = make(target)
        assert set(_states(state).values()) == {"Cached"}, (target, _states(state))
        if target == "eval":
            metrics = state.result()["linprobe"]
            assert {"result": metrics["result"], "baseline": metrics["baseline"]} == summary["evaluations"]["linprobe"]
        if target == "pretrain-dp":
            assert state.result()["checkpoint"] == summary["checkpoint"]


class _Lines(logging.Handler):
    """The formatted records of a logger, as a console shows them (traceback included)."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.text += logging.Formatter().format(record) + "\n"


@pytest.mark.parametrize(("error", "traceback_shown"), [
    (ConfigError("privacy.target_epsilon: 4.0 cannot be met: the data set has spent epsilon 7.9972"), False),
    (RuntimeError("a bug"), True),
], ids=["setting", "bug"])
def test_a_stage_refused_for_a_setting_is_one_line_in_the_log_and_a_bug_keeps_its_traceback(
        prefect_api, error, traceback_shown):
    from prefect import flow, task

    @task(name="refusing-stage")
    def stage():
        raise error

    @flow(name="refusing-flow")
    def refusing():
        stage()

    show_setting_errors_in_one_line()
    lines = _Lines()
    for name in RUN_LOGGERS:
        logging.getLogger(name).addHandler(lines)
    try:
        state = refusing(return_state=True)
    finally:
        for name in RUN_LOGGERS:
            logging.getLogger(name).removeHandler(lines)
    assert state.is_failed() and str(error) in lines.text
    assert ("Traceback" in lines.text) is traceback_shown
