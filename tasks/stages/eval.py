"""The evaluation task: one downstream job on a pre-trained encoder and, in the same run, on a randomly
initialised encoder of the same size (the baseline beside the result; ``evaluation.random_init_baseline``).

``run_evaluation`` writes ``metrics.json`` in ``output``: the job's metrics for the checkpoint's encoder
(``result``) and for the random-init encoder (``baseline``, None when it is off), side by side. With an MLflow run
id it logs a child run of that run (tag ``mlflow.parentRunId``), open from before the job starts until after it
ends, with ``eval/<name>/<metric>`` for the result and ``eval/<name>/<metric>_random_init`` for the baseline (the
name of a suite's pair, ``linprobe-imagenet``; the task's by default), and ``metrics.json`` as an artifact. Running
it again with the same task, settings, checkpoint and data reuses the stored metrics instead of recomputing (and
still logs them to MLflow when a parent run is given); a job stopped on the way resumes from what it wrote in
``output/work/<encoder>/`` (the linear probe's features, the training state after each epoch), which is removed
once the metrics are stored.

Where the job runs: on ``evaluation.device`` in this process, or, for the jobs that train (linprobe, finetune,
coco, ade20k) with ``evaluation.num_workers`` > 0, as a Ray Train job of that many workers (one GPU each on CUDA,
``tasks/stages/eval_workers.py``). Jobs submitted side by side queue there for the cluster's devices.

The data may be a local folder or an fsspec URL (``s3://bucket/digits``, :mod:`vip_core.data.storage`): a URL's
folder is copied once into ``$VIP_HOME/data/eval/``, named after the URL and the listing of its files (names,
sizes, ETags), and the job reads the copy; the same listing is the data's part of the job's fingerprint.

Evaluation data is public: the privacy guarantee of pre-training covers the pre-training data only.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tasks.runtime.environment import state_paths
from tasks.runtime.folders import StageFolder, eval_data_copy, fingerprint, identity
from tasks.runtime.names import EVAL_METRICS_FILE
from tasks.runtime.ray_session import ray_session
from vip_core.config import EVAL_TASK_FIELDS, TRAINING_TASKS, ModelConfig, VipConfig, validate_config

logger = logging.getLogger(__name__)

METRICS_FILE = EVAL_METRICS_FILE
WORK_FOLDER = "work"  # what the jobs write on the way, each encoder's in a folder of its own
BASELINE = "random-init encoder of the same size, same data, same settings, same run"
DATA_NOTE = "evaluation data is public: the pre-training privacy guarantee does not cover it"


def run_evaluation(config: VipConfig, task: str, checkpoint: str | None, data: str, output: str,
                   mlflow_run_id: str | None = None, name: str | None = None) -> dict[str, Any]:
    """Runs ``task`` on the encoder of ``checkpoint`` and on a random-init baseline; returns the metrics.

    Args:
        config: ``config.evaluation`` drives the job; ``config.model`` sizes the encoder when the
            checkpoint holds no config (a released MAE/ViP ``.pth``).
        task: ``linprobe``, ``finetune``, ``fewshot``, ``coco`` or ``ade20k``.
        checkpoint: a checkpoint file or run folder; None evaluates only a random-init encoder.
        data: the task's dataset folder (ImageFolder, COCO or ADE20K layout), local or an fsspec URL.
        output: the folder for ``metrics.json``.
        mlflow_run_id: the parent MLflow run; a child run is logged under it. None: no MLflow.
        name: the job's name in MLflow and in the folder's claim (a suite's pair, ``linprobe-imagenet``); ``task``
            when None.

    Returns:
        ``{"task", "checkpoint", "data", "result": {...}, "baseline": {...} | None, ...}``.

    Raises:
        FileNotFoundError: a missing checkpoint or dataset path (or a URL with no file below it).
        ValueError: an unknown task, malformed data or a bad setting (one line naming it).
    """
    from tasks.runtime import tracking

    name = name or task
    model_config = _model_config(config, checkpoint)
    folder = StageFolder(output, f"eval/{name}", _fingerprint(config, model_config, task, checkpoint, data),
                         result_name=METRICS_FILE)
    with tracking.optional_stage_run(mlflow_run_id, f"eval/{name}", config, name=f"eval-{name}") as run_id:
        metrics = folder.stored_result()
        if metrics is None:
            metrics = folder.store_result(_evaluate(config, model_config, task, checkpoint, data, folder))
            shutil.rmtree(Path(output) / WORK_FOLDER, ignore_errors=True)
        else:
            logger.info("%s: metrics for these inputs already in %s", name, folder.result_file)
        if run_id:
            log_evaluation(run_id, name, metrics, folder.result_file)
    return metrics


def _evaluate(config: VipConfig, model_config: ModelConfig, task: str, checkpoint: str | None, data: str,
              folder: StageFolder) -> dict[str, Any]:
    """The job on each encoder, timed; the data is checked before the folder is claimed or an encoder built."""
    from vip_core.eval.loading import resolve_device

    evaluation = config.evaluation
    on_workers = task in TRAINING_TASKS and evaluation.num_workers > 0
    device = torch.device("cpu") if on_workers else resolve_device(evaluation.device)  # the driver's: checks, plans
    encoders = encoder_builders(config, model_config, checkpoint)
    job, local_data = _prepare_job(config, model_config, task, data, folder.fingerprint["data"], device,
                                   list(encoders))
    folder.claim()
    metrics: dict[str, Any] = {"task": task, "checkpoint": None if checkpoint is None else str(checkpoint),
                               "data": str(data)}
    seconds = {}
    with ray_session(evaluation.num_workers, evaluation.cpus_per_worker) if on_workers else contextlib.nullcontext():
        for run, role in enumerate(encoders):
            started = time.monotonic()
            workspace = Path(folder.path) / WORK_FOLDER / role
            if on_workers:
                from tasks.stages.eval_workers import run_on_workers

                metrics[role], metrics["device"] = run_on_workers(config, model_config, task, local_data, checkpoint,
                                                                  role, run, workspace, getattr(job, "dp_runs", None))
            else:
                metrics[role], metrics["device"] = job(encoders[role](), run=run, workspace=workspace), str(device)
            seconds[role] = round(time.monotonic() - started, 2)
            logger.info("%s on the %s encoder: %s", task, role, metrics[role])
    metrics.setdefault("baseline", None)
    metrics.update(baseline_encoder=BASELINE if "baseline" in encoders else None, seconds=seconds, note=DATA_NOTE)
    if getattr(job, "privacy", None) is not None:  # DP fine-tuning: the runs charged to the set's ledger
        metrics["privacy"] = job.privacy
    return metrics


def _prepare_job(config: VipConfig, model_config: ModelConfig, task: str, data: str, data_identity: str,
                 device: torch.device, runs: list[str]) -> tuple[Callable[..., dict[str, Any]], str]:
    """The job opened on ``data`` and the folder it reads (a URL: its local copy, and an error about the copy names
    the URL)."""
    from vip_core.eval.jobs import prepare_job

    with eval_data_copy(data, data_identity) as local:
        return prepare_job(task, local, config.evaluation, model_config, device, runs=runs,
                           ledgers=state_paths()["ledgers"]), local


def _model_config(config: VipConfig, checkpoint: str | None) -> ModelConfig:
    """The checkpoint's own model config when it has one, else ``config.model``; a checkpoint without the weights
    ``evaluation.encoder_weights`` asks for fails here, before any job."""
    if checkpoint is None:
        return config.model
    from vip_core.models import load_checkpoint
    from vip_core.models.checkpoint import weights_entry

    payload = load_checkpoint(checkpoint)
    weights_entry(payload, config.evaluation.encoder_weights, checkpoint)
    if "config" not in payload:
        return config.model
    stored = validate_config(payload["config"]).model
    if stored != config.model:
        logger.warning("the checkpoint's model config differs from the preset's; using the checkpoint's")
    return stored


def encoder_builders(config: VipConfig, model_config: ModelConfig,
                     checkpoint: str | None) -> dict[str, Callable[[], nn.Module]]:
    """``result`` (the checkpoint's encoder, its final weights or their moving average as
    ``evaluation.encoder_weights`` says, or a random-init one without a checkpoint) and, with
    ``evaluation.random_init_baseline``, ``baseline``: each built the same way wherever it is built."""
    from vip_core.eval.seeding import job_seed, seeded
    from vip_core.models import build_encoder, load_encoder

    def random_init() -> nn.Module:
        with seeded(job_seed(config.evaluation.seed, "random-init encoder")):  # the same for every job
            return build_encoder(model_config)

    def trained() -> nn.Module:
        with seeded(job_seed(config.evaluation.seed, "checkpoint encoder")):  # built, then the weights loaded
            return load_encoder(checkpoint, model_config, weights=config.evaluation.encoder_weights)

    if checkpoint is None:
        return {"result": random_init}
    return {"result": trained, **({"baseline": random_init} if config.evaluation.random_init_baseline else {})}


def _fingerprint(config: VipConfig, model_config: ModelConfig, task: str, checkpoint: str | None,
                 data: str) -> dict[str, Any]:
    """What decides a job's metrics: the task, the settings it reads, the encoder and the data's path."""
    from vip_core.models.checkpoint import checkpoint_file

    fields = set(EVAL_TASK_FIELDS.get(task, ()))
    return {"task": task, "evaluation": config.evaluation.model_dump(mode="json", include=fields),
            "model": model_config.model_dump(mode="json"),
            "checkpoint": None if checkpoint is None else fingerprint(checkpoint_file(checkpoint)),
            "data": identity(data)}


def mlflow_metrics(name: str, metrics: dict[str, Any]) -> dict[str, float]:
    """``eval/<name>/<metric>`` for the result, ``eval/<name>/<metric>_random_init`` for the baseline."""
    flat = {f"eval/{name}/{metric}": value for metric, value in metrics["result"].items()}
    for metric, value in (metrics.get("baseline") or {}).items():
        flat[f"eval/{name}/{metric}_random_init"] = value
    return flat


def log_evaluation(run_id: str, name: str, metrics: dict[str, Any], metrics_file: Path) -> None:
    """The job's metrics, its checkpoint (tag ``vip.checkpoint``) and ``metrics.json`` into its child run."""
    from tasks.runtime import tracking

    tracking.set_tags(run_id, {"vip.checkpoint": str(metrics["checkpoint"])})
    tracking.log_metrics(run_id, mlflow_metrics(name, metrics))
    tracking.log_artifact(run_id, metrics_file)
