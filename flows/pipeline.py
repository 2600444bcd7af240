"""The end-to-end flow: ingest and render, pre-train on synthetic images, pre-train privately, evaluate.

```
url list ──► ingest ─────────────────────────────────┐
render ──► pretrain-syn (MAE, no DP) ──► checkpoint ──► pretrain-dp (DP-AdamW) ──► evaluate.map(tasks)
                                                                    audit (canaries) ┘ └─► register the encoder
```
Ingest and render run side by side; the evaluation jobs run in parallel, each beside the same job on a
randomly initialised encoder (its baseline), and so does the privacy audit of the private recipe. Every
stage writes to ``<workdir>/<stage>-<config digest>`` and is cached: running the flow again with the same
config skips the finished stages.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from flows.caching import stage_folder
from flows.stages import (
    audit, evaluate, flow_tracking, ingest, local_ray, pretrain, register_encoder, render, run_fresh_if_missing,
)
from tasks.runtime import results, tracking
from vip_core.config import VipConfig, tiny, with_overrides
from tasks.runtime.environment import configure_environment, state_paths

FLOW_NAME = "vip-pipeline"
EVAL_THREADS = 4
AUDIT_CANARIES = 1000
AUDIT_DELTA = 1e-5
# Where each evaluation task finds its data below the ``eval_data`` folder.
EVAL_DATA = {"linprobe": "classification", "finetune": "classification", "fewshot": "classification",
             "coco": "coco", "ade20k": "ade20k"}


def default_workdir(config: VipConfig) -> str:
    """``$VIP_HOME/runs/<config name>``."""
    return str(state_paths()["runs"] / config.name)


def stage_folders(config: VipConfig, workdir: str, url_list: str, eval_data: str) -> dict[str, str]:
    """Where each pre-evaluation stage writes, named after its config slice and its inputs' paths."""
    folders = {"ingest": stage_folder(workdir, "ingest", config, inputs=(url_list, eval_data)),
               "render": stage_folder(workdir, "render", config)}
    folders["pretrain-syn"] = stage_folder(workdir, "pretrain-syn", config, inputs=(folders["render"],))
    folders["pretrain-dp"] = stage_folder(
        workdir, "pretrain-dp", config, inputs=(folders["ingest"], folders["pretrain-syn"]))
    return folders


@flow(name=FLOW_NAME, task_runner=ThreadPoolTaskRunner(max_workers=EVAL_THREADS), log_prints=True)
def vip_pipeline(
    config: VipConfig = tiny(), url_list: str = "", eval_data: str = "", workdir: str = "",
    audit_canaries: int = AUDIT_CANARIES, audit_delta: float = AUDIT_DELTA,
) -> dict:
    """The whole ViP pipeline on one config.

    Args:
        config: the run's configuration (model, privacy, data, both pre-training stages, evaluation).
        url_list: a LAION-format parquet, csv or jsonl file of image URLs: the private pre-training data.
        eval_data: a folder with ``classification/`` (ImageFolder), ``coco/`` and ``ade20k/``; public data,
            also used to decontaminate the web images.
        workdir: where the stages write; empty: ``$VIP_HOME/runs/<config.name>``.
        audit_canaries: canaries of the privacy audit run beside the evaluations; 0: no audit.
        audit_delta: the δ the audit's recipe is calibrated at (its bound loses power as 2·canaries·δ grows,
            so a small one rather than 1/(2N) of a small data set).
    """
    configure_environment()
    workdir = workdir or default_workdir(config)
    folders = stage_folders(config, workdir, url_list, eval_data)
    with flow_tracking(FLOW_NAME, config) as parent, local_ray(config):
        web = run_fresh_if_missing(ingest, folders["ingest"]).submit(
            config, url_list, folders["ingest"], eval_data, parent)
        synthetic = run_fresh_if_missing(render, folders["render"]).submit(config, folders["render"], parent)
        warm = run_fresh_if_missing(pretrain, folders["pretrain-syn"]).submit(
            config, "synthetic", folders["render"], folders["pretrain-syn"], None, parent, wait_for=[synthetic])
        private = run_fresh_if_missing(pretrain, folders["pretrain-dp"]).submit(
            config, "private", folders["ingest"], folders["pretrain-dp"], warm.result()["checkpoint"], parent,
            wait_for=[web])
        checkpoint = private.result()["checkpoint"]
        audited = None
        if audit_canaries:
            audited_config = with_overrides(config, {"privacy.delta": audit_delta})
            audit_folder = f"{stage_folder(workdir, 'audit', audited_config)}-m{audit_canaries}"
            audited = run_fresh_if_missing(audit, audit_folder).submit(
                audited_config, audit_canaries, audit_folder, parent)
        evaluations = evaluate_all(config, checkpoint, eval_data, workdir, parent)
        registered = register_encoder(checkpoint, parent)
        summary = results.summarize(
            config=config, flow_run_id=str(flow_run.id), mlflow_run_id=parent, workdir=workdir,
            ingest=web.result(), render=synthetic.result(), pretrain_syn=warm.result(),
            pretrain_dp=private.result(), evaluations=evaluations, registered_model=registered,
            audit=audited.result() if audited else None,
        )
        tracking.log_metrics(parent, results.summary_metrics(summary), step=summary["privacy"]["steps"])
        tracking.client().log_dict(parent, summary, "results.json")
        create_markdown_artifact(results.markdown_table(summary), key="vip-results", description="ViP results")
    return summary


def evaluate_all(config: VipConfig, checkpoint: str, eval_data: str, workdir: str, parent: str) -> dict:
    """Every evaluation task on the encoder of ``checkpoint`` (each beside its random-init baseline), in parallel.

    Returns:
        ``{task: metrics}`` with ``metrics["result"]`` and ``metrics["baseline"]``.
    """
    tasks = list(config.evaluation.tasks)
    folder = Path(stage_folder(workdir, "evaluate", config, inputs=(checkpoint, eval_data)))
    futures = evaluate.map(
        unmapped(config),
        tasks,
        unmapped(checkpoint),
        [str(Path(eval_data) / EVAL_DATA[task]) for task in tasks],
        [str(folder / task) for task in tasks],
        unmapped(parent),
    )
    return {task: future.result() for task, future in zip(tasks, futures)}
