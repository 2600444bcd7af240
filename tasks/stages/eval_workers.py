"""An evaluation job on Ray Train: ``evaluation.num_workers`` data-parallel workers, one GPU each on CUDA.

:func:`run_on_workers` (the driver, inside :func:`tasks.stages.eval.run_evaluation`) runs one encoder's job as a
``TorchTrainer``, the way pre-training runs its stages (``tasks/stages/pretrain.py``): each worker rebuilds the
encoder and opens the data, then runs the same job as one process would (:mod:`vip_core.eval.jobs`), on its share
of every batch; rank 0 reports the metrics. DP fine-tuning's runs were planned and charged by the driver, once: the
workers get the plan (:class:`~vip_core.eval.jobs.DpRuns`), and the private step adds the noise on rank 0 only.

What a job writes on the way (the probe's features, the training state after each epoch) is in its workspace, the
job's folder: a worker group Ray Train restarts after a failure, or a job started again, goes on from there. Ray
Train's own run folder is ``<workspace>/ray``. Several machines need the workspace on a file system they share.

A job waits for its workers' resources however long the cluster is busy (``controller_failure_limit=-1``): the
jobs of a suite, submitted side by side, queue for the devices. A request the cluster can never meet (a GPU on a
cluster without one) fails at once.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from tasks.runtime.ray_session import ray_session, worker_environment
from vip_core.config import ModelConfig, VipConfig, validate_config

log = logging.getLogger(__name__)

MAX_FAILURES = 3
METRICS_FILE = "metrics.json"


def run_on_workers(config: VipConfig, model_config: ModelConfig, task: str, data: str, checkpoint: str | None,
                   role: str, run: int, workspace: Path, dp_runs: Any = None) -> tuple[dict[str, float], str]:
    """``task`` on the ``role`` encoder of ``checkpoint`` (the ``run``-th of the job), on Ray Train workers.

    Returns:
        The job's metrics (rank 0's) and where it ran (``"2 workers, cuda"``).
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    evaluation = config.evaluation
    with ray_session(evaluation.num_workers, evaluation.cpus_per_worker):
        use_gpu = _use_gpu(evaluation.device)
        loop_config = {
            "config": config.model_dump(mode="json"), "model": model_config.model_dump(mode="json"), "task": task,
            "data": str(data), "checkpoint": checkpoint, "role": role, "run": run, "workspace": str(workspace),
            "dp_runs": None if dp_runs is None else dp_runs.to_dict(), "use_gpu": use_gpu, "env": worker_environment(),
        }
        trainer = TorchTrainer(
            eval_worker,
            train_loop_config=loop_config,
            scaling_config=ScalingConfig(
                num_workers=evaluation.num_workers, use_gpu=use_gpu,
                resources_per_worker={"CPU": evaluation.cpus_per_worker, **({"GPU": 1} if use_gpu else {})},
            ),
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            run_config=RunConfig(
                name=role, storage_path=str((workspace / "ray").resolve()),
                failure_config=FailureConfig(max_failures=MAX_FAILURES, controller_failure_limit=-1),
                checkpoint_config=CheckpointConfig(num_to_keep=1),
            ),
        )
        result = trainer.fit()
    with open(Path(result.checkpoint.path) / METRICS_FILE) as file:
        metrics = json.load(file)
    return metrics, f"{evaluation.num_workers} workers, {'cuda' if use_gpu else 'cpu'}"


def _use_gpu(device: str) -> bool:
    """Whether the workers take a GPU each: ``cuda``, or ``auto`` on a cluster that has GPUs."""
    import ray

    return device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)


def eval_worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: open the data, build the encoder, run the job; rank 0 reports the metrics."""
    import ray.train
    import torch

    from tasks.stages.eval import encoder_builders
    from vip_core.eval.jobs import DpRuns, prepare_job
    from vip_core.eval.loading import worker_device
    from vip_core.train.distributed import rank_and_world

    os.environ.update(loop_config["env"])
    config = validate_config(loop_config["config"])
    model_config = ModelConfig.model_validate(loop_config["model"])
    device = worker_device(torch.device("cuda" if loop_config["use_gpu"] else "cpu"))
    dp_runs = DpRuns.from_dict(loop_config["dp_runs"]) if loop_config["dp_runs"] else None
    encoders = encoder_builders(config, model_config, loop_config["checkpoint"])
    job = prepare_job(loop_config["task"], loop_config["data"], config.evaluation, model_config, device,
                      runs=list(encoders), dp_runs=dp_runs)
    metrics = job(encoders[loop_config["role"]](), run=loop_config["run"], workspace=loop_config["workspace"])
    if rank_and_world()[0] != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="vip-eval-") as folder:
        with open(Path(folder) / METRICS_FILE, "w") as file:
            json.dump(metrics, file)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
