"""The evaluation jobs alone: every task on an encoder, each beside a random-init baseline, in parallel."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.pipeline import EVAL_THREADS, default_workdir, evaluate_all
from flows.stages import flow_tracking
from tasks.runtime import results, tracking
from vip_core.config import VipConfig, tiny
from tasks.runtime.environment import configure_environment


@flow(name="vip-evaluate", task_runner=ThreadPoolTaskRunner(max_workers=EVAL_THREADS), log_prints=True)
def evaluate_flow(config: VipConfig = tiny(), checkpoint: str = "", eval_data: str = "", workdir: str = "") -> dict:
    """Runs ``config.evaluation.tasks`` on the encoder of ``checkpoint`` and on a random-init one.

    Args:
        config: ``config.model`` and ``config.evaluation`` drive the jobs.
        checkpoint: a pre-training checkpoint (file or folder), as the private pre-training writes it.
        eval_data: a folder with ``classification/`` (ImageFolder), ``coco/`` and ``ade20k/``.
        workdir: empty: ``$VIP_HOME/runs/<config.name>``.

    Returns:
        ``{task: metrics}`` with ``metrics["result"]`` and ``metrics["baseline"]``.
    """
    configure_environment()
    workdir = workdir or default_workdir(config)
    with flow_tracking("vip-evaluate", config) as parent:
        evaluations = evaluate_all(config, checkpoint, eval_data, workdir, parent)
        tracking.log_metrics(parent, results.evaluation_metrics(evaluations))
    return evaluations
