"""Pre-training on Ray Train: the synthetic MAE stage (DP off) and the DP stage share one code path.

:func:`run_pretrain` (the driver) measures the data set, plans the privacy budget, starts or joins Ray and
runs a ``TorchTrainer`` whose workers each execute :func:`train_worker`:

* each worker owns a contiguous block of the shards (:class:`~vip_core.train.data.ShardPartition`) and
  Poisson-samples it at rate q = B / N with its own random stream; the union over workers is a Poisson
  sample of the whole data set at rate q, the rate the accountant is fed. The synthetic stage samples the
  same way (DP off: plain mean loss over the realised batch, no clipping, no noise);
* private step: clipped per-sample sums divided by the public expected batch size, the Gaussian noise
  drawn on rank 0 only, then a SUM all-reduce (total noise std σC whatever the number of workers); every
  rank takes the same AdamW step, and the parameters are checked bit-identical at every checkpoint;
* every ``checkpoint_every`` steps the workers report a checkpoint to Ray Train (model, optimizer,
  privacy ledger, every rank's sampler and random streams). When a worker dies, Ray Train replaces the
  worker group and training resumes from the last checkpoint with the ledger (ε) carried on;
* training stops before a step would take ε past the target;
* rank 0 logs ``train/loss``, ``privacy/epsilon``, ``train/lr`` and ``train/images_per_s`` every step to
  the stage's MLflow run.

The per-step training loss of the private stage is computed on private data and is not privatized:
the MLflow run of that stage is as sensitive as the data. So are Ray Train's checkpoints, which hold the
random streams' states; the published ``output/checkpoint`` leaves them out.

Fault injection for tests: ``VIP_INJECT_WORKER_KILL=RANK:STEP`` makes worker RANK kill its own process
(SIGKILL) right after step STEP, once per output folder.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import secrets
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vip_core.config import TrainingConfig, VipConfig, validate_config
from vip_core.train.data import ShardPartition, shard_counts, stream_generator
from vip_core.train.distributed import (
    all_reduce_gradients,
    all_reduce_max,
    all_reduce_sum,
    broadcast_parameters,
    check_parameters_equal,
    gather_objects,
    rank_and_world,
    rank_noise_multiplier,
    trainable_parameters,
)

if TYPE_CHECKING:
    from vip_core.privacy.ledger import PrivacyLedger
    from vip_core.privacy.sampling import PoissonSampler

log = logging.getLogger(__name__)

STAGES = {"synthetic": "pretrain-syn", "private": "pretrain-dp"}
RESULT_FILE = "result.json"
PLAN_FILE = "plan.json"
RESUME_INVARIANTS = ("private", "dataset_size", "sample_rate", "noise_multiplier", "max_grad_norm", "delta", "accountant")
FAULT_ENV = "VIP_INJECT_WORKER_KILL"
SECRET_ENTRIES = ("sampler", "rng")
MAX_FAILURES = 3
CHECKPOINTS_KEPT = 2


# ------------------------------------------------------------------------------------------------ driver


def run_pretrain(
    config: VipConfig,
    stage: str,
    data: str | Path,
    output: str | Path,
    init_checkpoint: str | Path | None = None,
    resume: bool = False,
    mlflow_run_id: str | None = None,
) -> dict[str, Any]:
    """Pre-trains the MAE for one stage on Ray Train and returns a summary.

    Args:
        config: the run's configuration; ``config.synthetic`` or ``config.private`` drives the stage.
        stage: ``"synthetic"`` (DP off) or ``"private"`` (DP-AdamW, Poisson sampling, accountant).
        data: folder of shards: webdataset tars, or parquet files with an image column.
        output: the stage's folder: Ray Train's checkpoints, the final ``checkpoint/``, ``result.json``.
        init_checkpoint: a checkpoint to start the weights from (the private stage's warm start).
        resume: continue the run left in ``output`` (its last checkpoint); without it a run in progress
            there is refused rather than overwritten.
        mlflow_run_id: the stage's MLflow run; a new top-level run when None.

    Returns:
        ``checkpoint`` (final checkpoint folder), ``steps``, ``epsilon`` (None for the synthetic stage),
        ``images_per_s``, ``peak_rss_mb`` (largest resident set of any worker) and more.
    """
    training = stage_training(config, stage)
    output = Path(output)
    finished = finished_result(output, config, stage, resume)
    if finished is not None:
        return finished
    continuing = (output / "ray" / STAGES[stage]).exists()
    if continuing and not resume:
        raise ValueError(f"{output} holds a {stage} run in progress: pass --resume to continue it or choose a new output")
    shards, counts = shard_counts(data)
    plan = _privacy_plan(config, stage, sum(counts))
    if init_checkpoint is not None:
        _check_init_checkpoint(init_checkpoint, config)
    _keep_plan(output, plan, continuing)
    run_id, own_run = _stage_run(mlflow_run_id, config, stage, plan)
    loop_config = {
        "config": config.model_dump(mode="json"),
        "stage": stage,
        "shards": [str(s) for s in shards],
        "counts": counts,
        "plan": plan,
        "init_checkpoint": str(init_checkpoint) if init_checkpoint else None,
        "mlflow_run_id": run_id,
        "env": _worker_environment(),
        "fault": _fault_injection(output),
        "checkpoint_root": str((output / "ray" / STAGES[stage]).resolve()),
    }
    summary = _fit(loop_config, training, output, stage, run_id, own_run)
    return summary


def stage_training(config: VipConfig, stage: str) -> TrainingConfig:
    """``config.synthetic`` or ``config.private``; an unknown stage is a ValueError."""
    if stage not in STAGES:
        raise ValueError(f"stage: unknown stage {stage!r} (known: {', '.join(STAGES)})")
    return getattr(config, stage)


def is_private(config: VipConfig, stage: str) -> bool:
    return stage == "private" and config.privacy.enabled


def finished_result(output: Path, config: VipConfig, stage: str, resume: bool) -> dict[str, Any] | None:
    """The summary of a finished run of the same config and stage in ``output``, if there is one.

    A finished run of another configuration is refused unless ``resume`` (continuing it, e.g. for more
    steps of the synthetic stage); a run of another stage is always refused.
    """
    result_file = output / RESULT_FILE
    if not result_file.is_file():
        return None
    result = json.loads(result_file.read_text())
    if result.get("stage") != stage:
        raise ValueError(f"{output} holds a finished {result.get('stage')} run: choose another output")
    if result.get("config") == config.model_dump(mode="json") and Path(result["checkpoint"]).is_dir():
        return {key: value for key, value in result.items() if key != "config"} | {"skipped": True}
    if not resume:
        raise ValueError(f"{output} holds a finished run of another configuration: pass --resume to continue it")
    return None


def _keep_plan(output: Path, plan: dict[str, Any], continuing: bool) -> None:
    """Records the plan of a new run; a continued run must have the same sampling and privacy settings,
    or its ledger (σ, q, δ) would not describe the steps taken."""
    plan_file = output / PLAN_FILE
    if not continuing or not plan_file.is_file():
        output.mkdir(parents=True, exist_ok=True)
        _write_json_atomically(plan_file, plan)
        return
    saved = json.loads(plan_file.read_text())
    changed = [key for key in RESUME_INVARIANTS if saved.get(key) != plan.get(key)]
    if changed:
        key = changed[0]
        raise ValueError(
            f"{output}: the run was planned with {key}={saved.get(key)}, the configuration now gives "
            f"{plan.get(key)}; resume with the same data and privacy settings or choose a new output"
        )


def _privacy_plan(config: VipConfig, stage: str, dataset_size: int) -> dict[str, Any]:
    """The privacy plan for the measured ``dataset_size`` (private stage), or the sampling rate alone."""
    training = stage_training(config, stage)
    if is_private(config, stage):
        from vip_core.privacy.plan import plan_privacy

        plan = plan_privacy(config, dataset_size)
        return {
            "private": True, "dataset_size": plan.dataset_size, "sample_rate": plan.sample_rate,
            "noise_multiplier": plan.noise_multiplier, "max_grad_norm": plan.max_grad_norm, "delta": plan.delta,
            "target_epsilon": plan.target_epsilon, "planned_epsilon": plan.epsilon, "accountant": plan.accountant,
        }
    if training.batch_size > dataset_size:
        raise ValueError(f"{stage}.batch_size {training.batch_size} exceeds the {dataset_size} images in the data")
    return {"private": False, "dataset_size": dataset_size, "sample_rate": training.batch_size / dataset_size}


def _check_init_checkpoint(path: str | Path, config: VipConfig) -> None:
    """Fails before Ray starts when the warm-start checkpoint is missing or does not fit the model."""
    from vip_core.models.checkpoint import load_mae

    load_mae(path, config.model)


def _stage_run(run_id: str | None, config: VipConfig, stage: str, plan: dict[str, Any]) -> tuple[str, bool]:
    """The MLflow run to log into (a new one when ``run_id`` is None) and whether this task owns it."""
    from tasks import tracking

    own = run_id is None
    if own:
        run_id = tracking.start_run(STAGES[stage], config=config, tags={tracking.STAGE_TAG: STAGES[stage]})
    tracking.set_tags(run_id, {f"plan.{key}": value for key, value in plan.items()})
    return run_id, own


def _worker_environment() -> dict[str, str]:
    """The variables workers need to find vip's state and the MLflow store, also on another node."""
    keys = ("VIP_HOME", "MLFLOW_TRACKING_URI")
    return {key: os.environ[key] for key in keys if key in os.environ}


def _fault_injection(output: Path) -> dict[str, Any] | None:
    """``VIP_INJECT_WORKER_KILL=RANK:STEP`` parsed, with the marker that makes it fire only once."""
    spec = os.environ.get(FAULT_ENV, "").strip()
    if not spec:
        return None
    try:
        rank, step = (int(part) for part in spec.split(":"))
    except ValueError:
        raise ValueError(f"{FAULT_ENV} must be RANK:STEP, got {spec!r}") from None
    return {"rank": rank, "step": step, "marker": str(output / "ray" / "fault-injected")}


def _fit(loop_config: dict, training: TrainingConfig, output: Path, stage: str, run_id: str, own_run: bool) -> dict:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from tasks import tracking
    from tasks.ray_runtime import ray_session

    trainer = TorchTrainer(
        train_worker,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(
            num_workers=training.num_workers, use_gpu=training.use_gpu,
            resources_per_worker={"CPU": training.cpus_per_worker, **({"GPU": 1} if training.use_gpu else {})},
        ),
        torch_config=TorchConfig(backend="nccl" if training.use_gpu else "gloo"),
        run_config=RunConfig(
            name=STAGES[stage], storage_path=str((output / "ray").resolve()),
            failure_config=FailureConfig(max_failures=MAX_FAILURES),
            checkpoint_config=CheckpointConfig(num_to_keep=CHECKPOINTS_KEPT),
        ),
    )
    try:
        with ray_session(training.num_workers, training.cpus_per_worker):
            result = trainer.fit()
    except BaseException:
        if own_run:
            tracking.end_run(run_id, "FAILED")
        raise
    summary = _summarise(result, loop_config, output, stage, run_id)
    if own_run:
        tracking.end_run(run_id, "FINISHED")
    return summary


def _summarise(result: Any, loop_config: dict, output: Path, stage: str, run_id: str) -> dict[str, Any]:
    """Publishes the last checkpoint as ``output/checkpoint`` and writes ``result.json``."""
    checkpoint = _publish_checkpoint(Path(result.checkpoint.path), output / "checkpoint")
    metrics = dict(result.metrics)
    plan = loop_config["plan"]
    summary = {
        "stage": stage,
        "checkpoint": str(checkpoint),
        "training_checkpoint": str(result.checkpoint.path),
        "steps": int(metrics["step"]),
        "epsilon": metrics.get("epsilon") if plan["private"] else None,
        "delta": plan.get("delta"),
        "noise_multiplier": plan.get("noise_multiplier"),
        "sample_rate": plan["sample_rate"],
        "dataset_size": plan["dataset_size"],
        "loss": metrics["loss"],
        "images_per_s": metrics["images_per_s"],
        "peak_rss_mb": metrics["peak_rss_mb"],
        "workers": int(metrics["world_size"]),
        "nodes": int(metrics["nodes"]),
        "resumes": int(metrics["resumes"]),
        "stopped_by_budget": bool(metrics["stopped_by_budget"]),
        "mlflow_run_id": run_id,
        "config": loop_config["config"],
    }
    _write_json_atomically(output / RESULT_FILE, summary)
    return {key: value for key, value in summary.items() if key != "config"}


def _publish_checkpoint(source: Path, target: Path) -> Path:
    """Writes the last training checkpoint without its random streams as ``target/checkpoint.pt``.

    The sampler and generator states would let anyone recompute the noise and the samples of past steps;
    they stay in Ray Train's checkpoints (``output/ray``), which only a resume reads. ``target`` is
    replaced whole, never half written.
    """
    from vip_core.models.checkpoint import CHECKPOINT_FILE, load_checkpoint

    payload = {key: value for key, value in load_checkpoint(source).items() if key not in SECRET_ENTRIES}
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    torch.save(payload, staging / CHECKPOINT_FILE)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return target


def _write_json_atomically(path: Path, payload: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload, indent=2, default=str))
    partial.replace(path)


# ------------------------------------------------------------------------------------------------ worker


@dataclass
class WorkerState:
    """What one worker holds between steps; everything but the data partition goes into checkpoints."""

    config: VipConfig
    stage: str
    plan: dict[str, Any]
    partition: ShardPartition
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: PoissonSampler
    masking: torch.Generator
    noise: torch.Generator
    ledger: PrivacyLedger | None = None
    step: int = 0
    resumes: int = 0
    stopped_by_budget: bool = False
    last_loss: float = float("nan")
    images: float = 0.0
    seconds: float = 0.0

    @property
    def training(self) -> TrainingConfig:
        return stage_training(self.config, self.stage)


def train_worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: restore or build the state, train, report checkpoints."""
    import ray.train

    os.environ.update(loop_config["env"])
    rank, world = rank_and_world()
    state = build_worker_state(loop_config, rank, world)
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as folder:
            restore_worker_state(state, folder, rank, world)
    elif (stored := latest_stored_checkpoint(Path(loop_config["checkpoint_root"]))) is not None:
        restore_worker_state(state, str(stored), rank, world)
    else:
        broadcast_parameters(state.model)
    metric_logger = _metric_logger(loop_config["mlflow_run_id"]) if rank == 0 else None
    training = state.training
    reported_at = -1
    while state.step < training.steps:
        if state.ledger is not None and not state.ledger.can_step(state.plan["target_epsilon"]):
            state.stopped_by_budget = True
            break
        metrics = train_step(state, rank)
        if metric_logger is not None:
            metric_logger(metrics, state.step)
        _maybe_kill(loop_config["fault"], rank, state.step)
        if state.step % training.checkpoint_every == 0 or state.step == training.steps:
            report_checkpoint(state, rank, world)
            reported_at = state.step
    if reported_at != state.step:
        report_checkpoint(state, rank, world)


def latest_stored_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint this run wrote under ``root``, or None.

    Ray Train hands a restarted worker group the last checkpoint its controller registered; one reported
    just before a worker died may not be registered yet. Starting such a run afresh would spend the
    privacy budget of the steps already taken a second time, so the run's own storage is the fallback.
    A checkpoint whose file does not load (a copy cut short) is passed over.
    """
    from vip_core.models.checkpoint import load_checkpoint

    for folder in sorted(root.glob("checkpoint_*"), reverse=True):
        try:
            load_checkpoint(folder)
        except Exception as error:  # a partial copy: torch.load raises various errors
            log.warning("passing over checkpoint %s: %s", folder, error)
            continue
        return folder
    return None


def build_worker_state(loop_config: dict[str, Any], rank: int, world: int) -> WorkerState:
    """A fresh state: data block, model (warm-started if asked), optimizer, sampler, ledger, streams."""
    from vip_core.models.checkpoint import load_checkpoint
    from vip_core.models.mae import build_mae
    from vip_core.privacy.sampling import PoissonSampler

    config = validate_config(loop_config["config"])
    stage, plan = loop_config["stage"], loop_config["plan"]
    training = stage_training(config, stage)
    entropy = secrets.randbits(63) if plan["private"] else training.seed
    torch.manual_seed(training.seed)
    model = build_mae(config.model)
    if loop_config["init_checkpoint"]:
        model.load_state_dict(load_checkpoint(loop_config["init_checkpoint"])["model"])
    if training.use_gpu:
        model = model.cuda()
    partition = ShardPartition(loop_config["shards"], loop_config["counts"], rank, world, config.model.img_size)
    sampler = PoissonSampler(len(partition), plan["sample_rate"], stream_generator(entropy, rank, "sampling"))
    state = WorkerState(
        config=config, stage=stage, plan=plan, partition=partition, model=model,
        optimizer=_optimizer(model, training), sampler=sampler,
        masking=stream_generator(entropy, rank, "masking"), noise=stream_generator(entropy, rank, "noise"),
    )
    if plan["private"]:
        from vip_core.privacy.ledger import PrivacyLedger

        state.ledger = PrivacyLedger(plan["noise_multiplier"], plan["sample_rate"], plan["delta"], plan["accountant"])
    return state


def _optimizer(model: torch.nn.Module, training: TrainingConfig) -> torch.optim.Optimizer:
    from vip_core.privacy.optimizer import dp_adamw

    return dp_adamw(model, lr=training.peak_lr, betas=training.betas, weight_decay=training.weight_decay)


def restore_worker_state(state: WorkerState, folder: str, rank: int, world: int) -> None:
    """Loads a reported checkpoint: weights, optimizer, step, ledger, and this rank's streams."""
    from vip_core.models.checkpoint import load_checkpoint

    payload = load_checkpoint(folder)
    state.model.load_state_dict(payload["model"])
    state.optimizer.load_state_dict(payload["optimizer"])
    state.step = int(payload["step"])
    state.resumes = int(payload["resumes"]) + 1
    state.last_loss = float(payload["last_loss"])
    if state.ledger is not None:
        from vip_core.privacy.ledger import PrivacyLedger

        state.ledger = PrivacyLedger.from_state_dict(payload["ledger"])
    if len(payload["sampler"]) == world:
        state.sampler.load_state_dict(payload["sampler"][rank])
        state.masking.set_state(payload["rng"][rank]["masking"])
        state.noise.set_state(payload["rng"][rank]["noise"])
    else:
        log.warning("checkpoint written by %d workers, now %d: fresh random streams", len(payload["sampler"]), world)
    log.info("rank %d resumed at step %d (resume %d)", rank, state.step, state.resumes)


def train_step(state: WorkerState, rank: int) -> dict[str, float]:
    """One logical step on every rank; returns the step's metrics (identical on every rank)."""
    from vip_core.privacy.optimizer import set_learning_rate
    from vip_core.train.schedule import lr_at

    training = state.training
    lr = lr_at(
        state.step, peak_lr=training.peak_lr, total_steps=training.steps, warmup_steps=training.warmup_steps,
        min_lr=training.min_lr, schedule=training.schedule,
    )
    set_learning_rate(state.optimizer, lr)
    started = time.perf_counter()
    local = state.sampler.sample()  # local: [B_r] indices into this worker's block
    noise = state.model.masking_noise(len(local), state.masking)  # noise: [B_r, L]
    if state.plan["private"]:
        loss_sum, count = _private_gradients(state, rank, local, noise)
    else:
        loss_sum, count = _plain_gradients(state, local, noise)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    if state.ledger is not None:
        state.ledger.record_step()
    seconds = time.perf_counter() - started
    state.last_loss = loss_sum / max(count, 1.0)
    state.images += count
    state.seconds += seconds
    return step_metrics(state, images_per_s=count / seconds)


def _mae_loss(partition: ShardPartition):
    def loss_fn(model: torch.nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        local, noise = inputs  # local: [b], noise: [b, L]
        device = next(model.parameters()).device
        imgs = partition.images(local).to(device)  # imgs: [b, 3, H, W]
        loss, _, _ = model(imgs, noise=noise.to(device))  # loss: [b]
        return loss

    return loss_fn


def _private_gradients(state: WorkerState, rank: int, local: torch.Tensor, noise: torch.Tensor) -> tuple[float, float]:
    """Clipped sums of this rank's samples plus (rank 0 only) the noise, over the expected batch; summed over ranks."""
    from vip_core.privacy.engine import privatized_gradients

    plan = state.plan
    stats = privatized_gradients(
        state.model, _mae_loss(state.partition), (local, noise),
        max_grad_norm=plan["max_grad_norm"],
        noise_multiplier=rank_noise_multiplier(plan["noise_multiplier"], rank),
        expected_batch_size=plan["sample_rate"] * plan["dataset_size"],
        physical_batch_size=state.training.physical_batch_size,
        generator=state.noise,
    )
    all_reduce_gradients(trainable_parameters(state.model))
    return all_reduce_sum(stats.loss_sum), all_reduce_sum(stats.examples)


def _plain_gradients(state: WorkerState, local: torch.Tensor, noise: torch.Tensor) -> tuple[float, float]:
    """The mean loss's gradient over the realised batch of all ranks (DP off), in microbatches."""
    loss_fn = _mae_loss(state.partition)
    size = state.training.physical_batch_size
    loss_sum = 0.0
    for local_chunk, noise_chunk in zip(torch.split(local, size), torch.split(noise, size)):
        loss = loss_fn(state.model, (local_chunk, noise_chunk)).sum()
        loss.backward()
        loss_sum += loss.item()
    params = trainable_parameters(state.model)
    all_reduce_gradients(params)
    count = all_reduce_sum(len(local))
    for param in params:
        param.grad.div_(max(count, 1.0))
    return all_reduce_sum(loss_sum), count


def step_metrics(state: WorkerState, images_per_s: float) -> dict[str, float]:
    """The metrics of the step just taken: step, loss, learning rate, images/s and (private) ε."""
    metrics = {
        "step": state.step,
        "loss": state.last_loss,
        "lr": state.optimizer.param_groups[0]["lr"],
        "images_per_s": images_per_s,
    }
    if state.ledger is not None:
        metrics["epsilon"] = state.ledger.epsilon
    return metrics


def report_checkpoint(state: WorkerState, rank: int, world: int) -> None:
    """Reports a checkpoint to Ray Train: rank 0 writes it with every rank's streams, after checking that
    every rank holds the same parameters."""
    import ray
    import ray.train

    check_parameters_equal(state.model)
    streams = gather_objects({
        "sampler": state.sampler.state_dict(),
        "rng": {"masking": state.masking.get_state(), "noise": state.noise.get_state()},
        "node": ray.get_runtime_context().get_node_id(),
    })
    peak_rss_mb = all_reduce_max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    average_images_per_s = state.images / state.seconds if state.seconds else 0.0
    summary = {
        **step_metrics(state, average_images_per_s),
        "peak_rss_mb": peak_rss_mb, "world_size": world, "nodes": len({s["node"] for s in streams}),
        "resumes": state.resumes,
        "stopped_by_budget": state.stopped_by_budget,
    }
    if rank != 0:
        ray.train.report(summary)
        return
    from vip_core.models.checkpoint import save_checkpoint

    with tempfile.TemporaryDirectory(prefix="vip-ckpt-") as folder:
        save_checkpoint(
            folder, model=state.model, config=state.config, stage=state.stage, step=state.step,
            optimizer=state.optimizer.state_dict(),
            ledger=state.ledger.state_dict() if state.ledger is not None else None,
            sampler=[s["sampler"] for s in streams], rng=[s["rng"] for s in streams],
            resumes=state.resumes, plan=state.plan, last_loss=state.last_loss,
        )
        ray.train.report(summary, checkpoint=ray.train.Checkpoint.from_directory(folder))


def _metric_logger(run_id: str):
    """Rank 0's per-step MLflow logging into the stage's run."""
    from tasks import tracking

    names = {"loss": "train/loss", "lr": "train/lr", "images_per_s": "train/images_per_s", "epsilon": "privacy/epsilon"}

    def log_step(metrics: dict[str, float], step: int) -> None:
        tracking.log_metrics(run_id, {names[k]: v for k, v in metrics.items() if k in names}, step=step)

    return log_step


def _maybe_kill(fault: dict[str, Any] | None, rank: int, step: int) -> None:
    """The fault injection: SIGKILL this worker's process once, after the given step on the given rank."""
    if fault is None or fault["rank"] != rank or fault["step"] != step:
        return
    marker = Path(fault["marker"])
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"rank {rank} killed after step {step}\n")
    log.warning("fault injection: killing rank %d (pid %d) after step %d", rank, os.getpid(), step)
    os.kill(os.getpid(), signal.SIGKILL)
