"""The end-to-end flow: ingest and render, pre-train on synthetic images, pre-train privately, evaluate.

```
url list ──► ingest ─────────────────────────────────┐
render ──► pretrain-syn (MAE, no DP) ──► checkpoint ──► pretrain-dp (DP-AdamW) ──► evaluate.map(tasks × {ViP, random init})
                                                                             └─► register the encoder
```
Ingest and render run side by side; the evaluation jobs run in parallel, each beside the same job on a
randomly initialised encoder (its baseline). Every stage writes to ``<workdir>/<stage>-<config digest>``
and is cached: running the flow again with the same config skips the finished stages.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from flows.caching import stage_folder
from flows.stages import evaluate, flow_tracking, ingest, pretrain, register_encoder, render, run_fresh_if_missing
from tasks import results, tracking
from vip_core.config import VipConfig, tiny
from vip_core.env import configure_environment, state_paths

FLOW_NAME = "vip-pipeline"
EVAL_THREADS = 4
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
def vip_pipeline(config: VipConfig = tiny(), url_list: str = "", eval_data: str = "", workdir: str = "") -> dict:
    """The whole ViP pipeline on one config.

    Args:
        config: the run's configuration (model, privacy, data, both pre-training stages, evaluation).
        url_list: a LAION-format parquet, csv or jsonl file of image URLs: the private pre-training data.
        eval_data: a folder with ``classification/`` (ImageFolder), ``coco/`` and ``ade20k/``; public data,
            also used to decontaminate the web images.
        workdir: where the stages write; empty: ``$VIP_HOME/runs/<config.name>``.
    """
    configure_environment()
    workdir = workdir or default_workdir(config)
    folders = stage_folders(config, workdir, url_list, eval_data)
    with flow_tracking(FLOW_NAME, config) as parent:
        web = run_fresh_if_missing(ingest, folders["ingest"]).submit(
            config, url_list, folders["ingest"], eval_data, parent)
        synthetic = run_fresh_if_missing(render, folders["render"]).submit(config, folders["render"], parent)
        warm = run_fresh_if_missing(pretrain, folders["pretrain-syn"]).submit(
            config, "synthetic", folders["render"], folders["pretrain-syn"], None, parent, wait_for=[synthetic])
        private = run_fresh_if_missing(pretrain, folders["pretrain-dp"]).submit(
            config, "private", folders["ingest"], folders["pretrain-dp"], warm.result()["checkpoint"], parent,
            wait_for=[web])
        checkpoint = private.result()["checkpoint"]
        evaluations = evaluate_encoders(config, checkpoint, eval_data, workdir, parent)
        registered = register_encoder(checkpoint, parent)
        summary = results.summarize(
            config=config, flow_run_id=str(flow_run.id), mlflow_run_id=parent, workdir=workdir,
            ingest=web.result(), render=synthetic.result(), pretrain_syn=warm.result(),
            pretrain_dp=private.result(), evaluations=evaluations, registered_model=registered,
        )
        tracking.log_metrics(parent, results.summary_metrics(summary), step=summary["privacy"]["steps"])
        tracking.client().log_dict(parent, summary, "results.json")
        create_markdown_artifact(results.markdown_table(summary), key="vip-results", description="ViP results")
    return summary


def evaluate_encoders(config: VipConfig, checkpoint: str, eval_data: str, workdir: str, parent: str) -> dict:
    """Every evaluation task on the ViP encoder and on a random-init one, in parallel.

    Returns:
        ``{task: {"vip": metrics, "random-init": metrics}}``.
    """
    jobs = [(task, encoder, ckpt) for task in config.evaluation.tasks
            for encoder, ckpt in (("vip", checkpoint), ("random-init", None))]
    folder = Path(stage_folder(workdir, "evaluate", config, inputs=(checkpoint, eval_data)))
    outputs = [str(folder / f"{task}-{encoder}") for task, encoder, _ in jobs]
    futures = evaluate.map(
        unmapped(config),
        [task for task, _, _ in jobs],
        [ckpt for _, _, ckpt in jobs],
        [str(Path(eval_data) / EVAL_DATA[task]) for task, _, _ in jobs],
        outputs,
        unmapped(parent),
    )
    by_task: dict[str, dict] = {}
    for (task, encoder, _), future in zip(jobs, futures):
        by_task.setdefault(task, {})[encoder] = future.result()
    return by_task
