"""The evaluation's own flow (``make eval``): every task on an encoder, each beside a random-init baseline."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.graph import EVAL_THREADS, stage_graph
from tasks.runtime import results, tracking
from vip_core.config import VipConfig, tiny


@flow(name="vip-eval", task_runner=ThreadPoolTaskRunner(max_workers=EVAL_THREADS))
def eval_flow(config: VipConfig = tiny(), url_list: str = "", eval_data: str = "", workdir: str = "",
              checkpoint: str = "", image_folder: str = "") -> dict:
    """Runs ``config.evaluation.tasks`` on the encoder of ``checkpoint`` and on a random-init one.

    Args:
        config: ``config.model`` and ``config.evaluation`` drive the jobs.
        url_list: the pipeline's url list, whose private pre-training gives the encoder when no checkpoint is
            named (the stages before it run first, or are Cached).
        eval_data: a folder or fsspec URL (``s3://bucket/eval``) with ``classification/`` (ImageFolder), ``coco/``
            and ``ade20k/``.
        workdir: empty: ``$VIP_HOME/runs/<config.name>``.
        checkpoint: a checkpoint (file or folder) to evaluate instead of the pipeline's encoder.
        image_folder: the pipeline's image folder, read instead of ``url_list``.

    Returns:
        ``{task: metrics}`` with ``metrics["result"]`` and ``metrics["baseline"]``.
    """
    with stage_graph("vip-eval", config, url_list=url_list, eval_data=eval_data, workdir=workdir,
                     image_folder=image_folder) as graph:
        evaluations = graph.evaluations(checkpoint or None)
        tracking.log_metrics(graph.parent_run_id, results.evaluation_metrics(evaluations))
        return evaluations
