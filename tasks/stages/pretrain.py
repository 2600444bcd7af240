"""Pre-training on Ray Train: the synthetic MAE stage (DP off) and the DP stage share one code path.

:func:`run_pretrain` (the driver) measures the data set, plans the privacy budget against the data set's
ledger book (and charges it), starts or joins Ray and runs a ``TorchTrainer`` whose workers each execute
:func:`train_worker`:

* each worker owns a contiguous block of the shards (:class:`~vip_core.train.data.ShardPartition`) and
  runs :class:`~vip_core.train.step.PrivateStep` (the private stage) or :class:`~vip_core.train.step.PlainStep`
  (the synthetic stage) on it through :func:`~vip_core.train.loop.run_steps`: Poisson sampling of the block at
  rate q = B / N, so the union over workers is a Poisson sample of the whole data set at the q the
  accountant is fed; clipped sums over B, the noise on rank 0 only, a SUM all-reduce;
* every ``checkpoint_every`` steps the workers report a training checkpoint to Ray Train (model, optimiser,
  plan, ledger, every rank's sampler and random streams), after checking that every rank holds the same
  parameters. When a worker dies, Ray Train replaces the worker group and training resumes from the last
  checkpoint with the ledger (ε) carried on; a resume whose plan differs from the checkpoint's is refused;
* training stops before a step would take the data set's ε past the target;
* rank 0 logs ``privacy/epsilon`` and ``train/lr`` every step to the stage's MLflow run, and ``train/loss`` and
  ``train/images_per_s`` (for the private stage only with ``privacy.log_private_statistics`` on, which logs a warning);
* at the end the driver settles the run's charge with the steps taken and publishes ``output/checkpoint``:
  exactly the weights, the config, the step, the ledger and, with ``ema_decay`` > 0, the moving average of the
  weights (``PUBLISHED_ENTRIES``).

The per-step loss and throughput of the private stage, and the count of damaged images skipped, are computed
on private data and are not privatized (docs/privacy.md lists every such value and where it goes). So are Ray Train's checkpoints,
which hold the random streams' states: they stay under ``output/ray``.

Fault injection for tests: ``VIP_INJECT_WORKER_KILL=RANK:STEP`` makes worker RANK kill its own process
(SIGKILL) right after step STEP, once per output folder.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tasks.runtime.environment import state_paths
from tasks.runtime.names import PRETRAIN_STAGES
from tasks.runtime.ray_session import worker_environment
from vip_core.atomic import atomic_path, write_json
from vip_core.config import TrainingConfig, VipConfig, validate_config
from vip_core.train.augment import draw_crop_flips
from vip_core.train.data import ShardPartition, measure_shards
from vip_core.train.distributed import (
    all_reduce_max, all_reduce_sum, broadcast_parameters, check_parameters_equal, gather_objects, rank_and_world,
)
from vip_core.train.ema import WeightAverage
from vip_core.train.pipeline import DECODE_MODE, InputPipeline, decode_workers, mae_loss
from vip_core.train.step import StepReport, TrainingStep

if TYPE_CHECKING:
    from vip_core.privacy.ledger import LedgerBook
    from vip_core.privacy.plan import PrivacyPlan
    from vip_core.train.data import ShardSet

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"
PLAN_FILE = "plan.json"
FAULT_ENV = "VIP_INJECT_WORKER_KILL"
MAX_FAILURES = 3
CHECKPOINTS_KEPT = 2
PREFETCH_STEPS = 2  # steps whose samples are drawn and decoded ahead of the one being taken


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
        data: folder of shards (a local path or an fsspec URL such as ``s3://bucket/shards``): webdataset
            tars, or parquet files with an image column.
        output: the stage's folder: Ray Train's checkpoints, the final ``checkpoint/``, ``result.json``.
        init_checkpoint: a checkpoint to start the weights from (the private stage's warm start).
        resume: continue the run left in ``output`` (its last checkpoint); without it a run in progress
            there is refused rather than overwritten.
        mlflow_run_id: the stage's MLflow run; a new top-level run when None.

    Returns:
        ``checkpoint`` (final checkpoint folder), ``steps``, ``epsilon`` (the data set's composed ε; None for
        the synthetic stage), ``epsilon_pld`` (the tight PLD ε, beside a plan accounted by RDP),
        ``images_per_s``, ``peak_rss_mb`` (largest resident set of any worker) and ``damaged_images_skipped``
        (sampled images that did not decode and contributed nothing, :mod:`vip_core.train.data`; all three
        left out of a private stage with ``privacy.log_private_statistics`` off) and more.
    """
    training = stage_training(config, stage)
    output = Path(output)
    finished = finished_result(output, config, stage, resume)
    if finished is not None:
        return finished
    continuing = (output / "ray" / PRETRAIN_STAGES[stage]).exists()
    if continuing and not resume:
        raise ValueError(f"{output} holds a {stage} run in progress: pass --resume to continue it or choose a new output")
    shard_set = measure_shards(data)
    if init_checkpoint is not None:
        _check_init_checkpoint(init_checkpoint, config)
    plan = stage_plan(config, stage, shard_set, output, continuing)
    run_id, own_run = _stage_run(mlflow_run_id, config, stage, plan)
    loop_config = {
        "config": config.model_dump(mode="json"),
        "stage": stage,
        "shards": [str(s) for s in shard_set.shards],
        "counts": shard_set.counts,
        "plan": plan,
        "init_checkpoint": str(init_checkpoint) if init_checkpoint else None,
        "mlflow_run_id": run_id,
        "env": worker_environment(),
        "fault": _fault_injection(output),
        "checkpoint_root": str((output / "ray" / PRETRAIN_STAGES[stage]).resolve()),
    }
    return _fit(loop_config, training, output, stage, run_id, own_run)


def stage_training(config: VipConfig, stage: str) -> TrainingConfig:
    """``config.synthetic`` or ``config.private``; an unknown stage is a ValueError."""
    if stage not in PRETRAIN_STAGES:
        raise ValueError(f"stage: unknown stage {stage!r} (known: {', '.join(PRETRAIN_STAGES)})")
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


PRIVATE_STATISTICS_WARNING = (
    "privacy.log_private_statistics is on: the private stage's per-step loss and images/s (MLflow train/loss, "
    "train/images_per_s) and result.json's loss, images_per_s, peak_rss_mb and damaged_images_skipped are computed "
    "from the private data and leave the run without noise; the (epsilon, delta) guarantee does not cover them")


def stage_plan(config: VipConfig, stage: str, data: "ShardSet", output: Path, continuing: bool) -> dict[str, Any]:
    """The stage's plan for the measured data, kept in ``output/plan.json``.

    The private stage is planned against its data set's ledger book and charged there (its planned steps)
    before any step is taken. A continued run keeps its run id and the other runs its plan composed with,
    and must plan the same N, data, q, B, δ, accountant, C, σ and random mode, or its ledger would not
    describe the steps taken: otherwise it is refused, naming the first field that differs.
    """
    fingerprint, dataset_size = data.fingerprint, sum(data.counts)
    stored = _stored_plan(output) if continuing else None
    run = stored["run"] if stored else uuid.uuid4().hex
    if stored is not None and stored.get("private") != is_private(config, stage):
        raise ValueError(f"{output}: resume refused: the run was planned with private={stored.get('private')}, "
                         f"the configuration now gives {is_private(config, stage)}; choose a new output")
    trains_pos_embed = stage_training(config, stage).train_pos_embed
    _check_same_trainable_set(trains_pos_embed, stage, stored, output)
    if stage == "private" and not config.privacy.enabled:
        _charge_without_privacy(config, fingerprint, dataset_size, run)
    if is_private(config, stage):
        privacy = _private_plan(config, dataset_size, fingerprint, run, stored)
        plan = {"private": True, "run": run, "dataset_size": dataset_size, "fingerprint": fingerprint,
                "sample_rate": privacy.sample_rate, "privacy": privacy.to_dict()}
        log.info("private stage planned: N %d, q %.3g, sigma %.4g, delta %.3g, %d steps: %s", dataset_size,
                 privacy.sample_rate, privacy.noise_multiplier, privacy.delta, privacy.steps,
                 privacy.describe_epsilon())
        if config.privacy.log_private_statistics:
            log.warning(PRIVATE_STATISTICS_WARNING)
    else:
        training = stage_training(config, stage)
        if training.batch_size > dataset_size:
            raise ValueError(f"{stage}.batch_size {training.batch_size} exceeds the {dataset_size} images in the data")
        plan = {"private": False, "run": run, "dataset_size": dataset_size, "fingerprint": fingerprint,
                "sample_rate": training.batch_size / dataset_size}
        changed = next((key for key in ("dataset_size", "fingerprint", "sample_rate")
                        if stored and stored.get(key) != plan[key]), None)
        if changed:
            raise ValueError(f"{output}: resume refused: the run was planned with {changed}={stored[changed]!r}, "
                             f"the configuration now gives {plan[changed]!r}; choose a new output")
    if stored is None or "train_pos_embed" in stored:  # a plan from before the field keeps it unrecorded, unchecked
        plan["train_pos_embed"] = trains_pos_embed
    output.mkdir(parents=True, exist_ok=True)
    write_json(output / PLAN_FILE, plan)
    return plan


def _check_same_trainable_set(trains: bool, stage: str, stored: dict[str, Any] | None, output: Path) -> None:
    """A continued run trains the parameters it started with: its optimiser's state holds one entry per trained
    tensor, so a flipped ``train_pos_embed`` could not be resumed. A plan written before vip recorded it is not
    checked (its run may have trained them)."""
    if stored is not None and stored.get("train_pos_embed", trains) != trains:
        raise ValueError(f"{output}: resume refused: the run was planned with {stage}.train_pos_embed="
                         f"{str(not trains).lower()}, the configuration now gives {str(trains).lower()}; set it back "
                         "or choose a new output")


def _private_plan(config: VipConfig, dataset_size: int, fingerprint: str, run: str,
                  stored: dict[str, Any] | None) -> "PrivacyPlan":
    """A new run is planned and charged; a continued one is planned against its original prior and checked."""
    from vip_core.privacy.plan import PrivacyPlan, plan_and_charge, plan_privacy

    book = ledger_book(fingerprint)
    planning = dict(budget=config.privacy, dataset_size=dataset_size, batch_size=config.private.batch_size,
                    steps=config.private.steps, fingerprint=fingerprint)
    if stored is None or "privacy" not in stored:
        return plan_and_charge(book, runs=[run], purpose=PRETRAIN_STAGES["private"], **planning)
    original = PrivacyPlan.from_dict(stored["privacy"])
    plan = plan_privacy(prior=original.prior, **planning)
    mismatch = plan.mismatch(stored["privacy"])
    if mismatch is not None:
        raise ValueError(f"resume refused: the run was planned with {mismatch}; resume with the same data and "
                         "privacy settings or choose a new output")
    with book.locked():
        book.charge(plan.charge(run, PRETRAIN_STAGES["private"]))
    return plan


def _charge_without_privacy(config: VipConfig, fingerprint: str, dataset_size: int, run: str) -> None:
    """Training on the private data with privacy off spends its whole budget: charged with σ = 0 (ε = ∞), so
    that no later run on the set can claim a finite ε."""
    from vip_core.privacy.ledger import Charge

    log.warning("privacy.enabled is false: the private stage trains on its data without differential privacy; "
                "the data set's ledger is charged with epsilon = infinity")
    book = ledger_book(fingerprint)
    with book.locked():
        book.charge(Charge(run, 0.0, min(1.0, config.private.batch_size / dataset_size), config.private.steps,
                           "pretrain-nonprivate"))


def ledger_book(fingerprint: str) -> "LedgerBook":
    """The ledger book of the private data set ``fingerprint`` (in ``$VIP_LEDGER_DIR``, else ``$VIP_HOME/ledgers``)."""
    from vip_core.privacy.ledger import LedgerBook

    return LedgerBook.for_data_set(fingerprint, state_paths()["ledgers"])


def _stored_plan(output: Path) -> dict[str, Any] | None:
    plan_file = output / PLAN_FILE
    return json.loads(plan_file.read_text()) if plan_file.is_file() else None


def _check_init_checkpoint(path: str | Path, config: VipConfig) -> None:
    """Fails before Ray starts when the warm-start checkpoint is missing or does not fit the model."""
    from vip_core.models.checkpoint import load_mae

    load_mae(path, config.model)


def _stage_run(run_id: str | None, config: VipConfig, stage: str, plan: dict[str, Any]) -> tuple[str, bool]:
    """The MLflow run to log into (a new one when ``run_id`` is None) and whether this task owns it."""
    from tasks.runtime import tracking

    own = run_id is None
    if own:
        run_id = tracking.start_run(PRETRAIN_STAGES[stage], config=config, tags={tracking.STAGE_TAG: PRETRAIN_STAGES[stage]})
    tracking.set_tags(run_id, {f"plan.{key}": value for key, value in _plan_tags(plan).items()})
    return run_id, own


# Plan entries kept out of MLflow: the data set's fingerprint is a digest of the private data (it tells data
# sets apart exactly) and stays in plan.json and the ledger's file name; the other runs are in the ledger.
_UNTAGGED = ("privacy", "prior", "fingerprint")


def _plan_tags(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan as flat tags: ``dataset_size``, ``sample_rate``, and the privacy plan's scalars."""
    merged = {**plan, **plan.get("privacy", {})}
    return {key: value for key, value in merged.items() if key not in _UNTAGGED}


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

    from tasks.runtime import tracking
    from tasks.runtime.ray_session import ray_session

    trainer = TorchTrainer(
        train_worker,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(
            num_workers=training.num_workers, use_gpu=training.use_gpu,
            resources_per_worker={"CPU": training.cpus_per_worker, **({"GPU": 1} if training.use_gpu else {})},
        ),
        torch_config=TorchConfig(backend="nccl" if training.use_gpu else "gloo"),
        run_config=RunConfig(
            name=PRETRAIN_STAGES[stage], storage_path=str((output / "ray").resolve()),
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
    """Settles the run's charge, publishes the last checkpoint as ``output/checkpoint``, writes ``result.json``."""
    from vip_core.privacy.ledger import ADJACENCY

    checkpoint = _publish_checkpoint(Path(result.checkpoint.path), output / "checkpoint")
    metrics = dict(result.metrics)
    plan = loop_config["plan"]
    steps = int(metrics["step"])
    privacy = plan.get("privacy") or {}
    if plan["private"]:
        _settle(plan, steps)
    summary = {
        "stage": stage,
        "checkpoint": str(checkpoint),
        "training_checkpoint": str(result.checkpoint.path),
        "steps": steps,
        "epsilon": metrics.get("epsilon") if plan["private"] else None,
        **_tight_epsilon(plan, steps),
        "delta": privacy.get("delta"),
        "adjacency": ADJACENCY if plan["private"] else None,
        "noise_multiplier": privacy.get("noise_multiplier"),
        "sample_rate": plan["sample_rate"],
        "dataset_size": plan["dataset_size"],
        **{key: metrics[key] for key in ("loss", "images_per_s", "peak_rss_mb", "damaged_images_skipped")
           if key in metrics},
        "workers": int(metrics["world_size"]),
        "nodes": int(metrics["nodes"]),
        "resumes": int(metrics["resumes"]),
        "stopped_by_budget": bool(metrics["stopped_by_budget"]),
        "mlflow_run_id": run_id,
        "config": loop_config["config"],
    }
    write_json(output / RESULT_FILE, summary)
    return {key: value for key, value in summary.items() if key != "config"}


def _tight_epsilon(plan: dict[str, Any], steps: int) -> dict[str, float]:
    """``epsilon_pld``, the tight ε after ``steps`` steps, when the private plan is accounted by RDP (the paper's)."""
    from vip_core.privacy.plan import PrivacyPlan

    tight = PrivacyPlan.from_dict(plan["privacy"]).tight_epsilon(steps) if plan["private"] else None
    return {} if tight is None else {"epsilon_pld": tight}


def _settle(plan: dict[str, Any], steps: int) -> None:
    """Sets the run's charge in its data set's book to the steps it took."""
    from vip_core.privacy.plan import PrivacyPlan, settle_charge

    privacy = PrivacyPlan.from_dict(plan["privacy"])
    settle_charge(ledger_book(privacy.fingerprint), privacy, plan["run"], PRETRAIN_STAGES["private"], steps)


def _publish_checkpoint(source: Path, target: Path) -> Path:
    """Writes the release of the last training checkpoint as ``target/checkpoint.pt``: exactly the weights,
    the config, the step, the ledger and the weights' moving average or None (``PUBLISHED_ENTRIES``). ``target``
    is replaced whole, never half written. The optimiser, the plan and the random streams stay in Ray Train's
    checkpoints (``output/ray``), which only a resume reads."""
    from vip_core.models.checkpoint import CHECKPOINT_FILE, load_checkpoint, release_payload

    payload = release_payload(load_checkpoint(source))
    with atomic_path(target) as staging:
        staging.mkdir()
        torch.save(payload, staging / CHECKPOINT_FILE)
    return target


# ------------------------------------------------------------------------------------------------ worker


@dataclass
class WorkerRun:
    """What one worker holds: the stage, its plan, its block of the data, its training step and the input
    pipeline that draws and decodes the step's samples ahead."""

    config: VipConfig
    stage: str
    plan: dict[str, Any]
    partition: ShardPartition
    step: TrainingStep
    pipeline: InputPipeline
    resumes: int = 0
    images: float = 0.0
    seconds: float = 0.0
    damaged: int = 0  # sampled images that did not decode, skipped (rank 0 holds the count before a resume)
    ema: WeightAverage | None = None  # the moving average of the weights, with ema_decay > 0

    @property
    def training(self) -> TrainingConfig:
        return stage_training(self.config, self.stage)

    @property
    def model(self) -> torch.nn.Module:
        return self.step.model

    @property
    def logs_private_statistics(self) -> bool:
        """Whether values computed from the data and not privatized may leave the worker."""
        return not self.plan["private"] or self.config.privacy.log_private_statistics

    def batch(self, local: torch.Tensor, stream: Any) -> tuple[torch.Tensor, ...]:
        """The step's inputs: the sample's decoded images [k, 3, H, W] (uint8, from the pipeline), one row of
        masking noise per sample [k, K * L] and, with ``augmentation: rrc_flip``, one row of crop boxes and flips
        per sample [k, K * 5], both from the step's per-sample stream, for each of the K =
        ``augmentation_multiplicity`` views in turn (K = 1 draws exactly what a run without views draws). An image
        that did not decode is left out, with its rows (drawn all the same), and counted: it contributes nothing
        to the step (:mod:`vip_core.train.data`)."""
        decoded, views = self.pipeline.pixels(local), self.training.augmentation_multiplicity
        inputs = (decoded.pixels, stream.uniform((len(local), views * self.model.num_patches)))
        if self.training.augmentation != "none":
            crops = draw_crop_flips(stream, len(local) * views, scale=self.training.crop_scale,
                                    ratio=self.training.crop_ratio)  # [k * K, 5]: sample by sample, view by view
            inputs += (crops.reshape(len(local), views * crops.shape[1]),)
        self.damaged += int((~decoded.usable).sum())
        return inputs if bool(decoded.usable.all()) else tuple(value[decoded.usable] for value in inputs)

    def loss(self, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The MAE's per-sample loss [b] of uint8 images ``inputs[0]`` under masks ``inputs[1]`` (cropped and
        flipped by ``inputs[2]`` when there is one), normalised on the model's device, in the stage's precision,
        averaged over the K views of each image."""
        pixels, noise, *crops = inputs  # pixels: [b, 3, H, W] uint8, noise: [b, K * L], crops: [] or [[b, K * 5]]
        return mae_loss(model, pixels, noise, self.training.precision, *crops,
                        views=self.training.augmentation_multiplicity)  # [b]

    def average_weights(self) -> None:
        """Moves the moving average (with ``ema_decay`` > 0) towards the weights the step just released."""
        if self.ema is not None:
            self.ema.update(self.model)

    def metrics(self, report: StepReport | None, rank: int) -> dict[str, float]:
        """The metrics of the step just taken: step, lr, ε (private, rank 0) and, where allowed, loss and images/s."""
        metrics = self.step_metrics(report)
        if rank == 0 and self.step.epsilon is not None:
            metrics["epsilon"] = self.step.epsilon
        return metrics

    def step_metrics(self, report: StepReport | None) -> dict[str, float]:
        """:meth:`metrics` without ε."""
        metrics: dict[str, float] = {"step": self.step.taken, "lr": self.step.optimizer.param_groups[0]["lr"]}
        if report is not None and self.logs_private_statistics:
            metrics.update(loss=report.loss, images_per_s=report.examples / report.seconds)
        return metrics


# The MLflow name of each per-step metric rank 0 logs.
METRIC_NAMES = {"loss": "train/loss", "lr": "train/lr", "images_per_s": "train/images_per_s",
                "epsilon": "privacy/epsilon"}


def train_worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: restore or build the run, train, report checkpoints."""
    import ray.train

    from vip_core.train.loop import run_steps

    os.environ.update(loop_config["env"])
    rank, world = rank_and_world()
    run = build_worker_run(loop_config, rank, world)
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as folder:
            restore_worker_run(run, folder, rank, world)
    elif (stored := latest_stored_checkpoint(Path(loop_config["checkpoint_root"]))) is not None:
        restore_worker_run(run, str(stored), rank, world)
    else:
        broadcast_parameters(run.model)
    from tasks.runtime.tracking import StepLogger

    step_logger = StepLogger(loop_config["mlflow_run_id"], METRIC_NAMES) if rank == 0 else None
    last: list[StepReport] = []

    def on_step(report: StepReport) -> None:
        last[:] = [report]
        run.images += report.examples
        run.seconds += report.seconds
        run.average_weights()
        if step_logger is not None:
            step_logger.log(report.step, run.step_metrics(report), {"epsilon": report.epsilon_of})
        _maybe_kill(loop_config["fault"], rank, report.step)

    def on_checkpoint() -> None:
        if step_logger is not None:
            step_logger.flush()  # a run resumed from this checkpoint logs only the steps after it
        report_checkpoint(run, last[0] if last else None, rank, world)

    training = run.training
    try:
        run_steps(run.step, run.batch, run.loss, until=training.steps, on_step=on_step, on_checkpoint=on_checkpoint,
                  checkpoint_every=training.checkpoint_every)
    finally:
        run.pipeline.close()
        if step_logger is not None:
            step_logger.close()


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


def build_worker_run(loop_config: dict[str, Any], rank: int, world: int) -> WorkerRun:
    """A fresh run: data block, model (warm-started if asked) and the stage's training step."""
    from vip_core.models.checkpoint import load_checkpoint
    from vip_core.models.mae import build_mae

    config = validate_config(loop_config["config"])
    stage, plan = loop_config["stage"], loop_config["plan"]
    training = stage_training(config, stage)
    with torch.random.fork_rng():  # the initial weights are public: the config seed, not the global stream
        torch.manual_seed(training.seed)
        model = build_mae(config.model)
    if loop_config["init_checkpoint"]:
        model.load_state_dict(load_checkpoint(loop_config["init_checkpoint"])["model"])
    for position_embedding in (model.pos_embed, model.decoder_pos_embed):  # [1, L + 1, D]: the engine clips them
        position_embedding.requires_grad_(training.train_pos_embed)
    if training.use_gpu:
        model = model.cuda()
    partition = ShardPartition(loop_config["shards"], loop_config["counts"], rank, world, config.model.img_size)
    step = _training_step(model, plan, training, len(partition))
    workers = decode_workers(training.cpus_per_worker)
    pipeline = step.prefetch(partition.decode, ahead=PREFETCH_STEPS, workers=workers, mode=DECODE_MODE,
                             pin_memory=training.use_gpu)
    ema = WeightAverage(model, training.ema_decay) if training.ema_decay > 0 else None
    return WorkerRun(config=config, stage=stage, plan=plan, partition=partition, step=step, pipeline=pipeline,
                     ema=ema)


def _training_step(model: torch.nn.Module, plan: dict[str, Any], training: TrainingConfig,
                   local_size: int) -> TrainingStep:
    """The private step of the plan, or the plain step keyed by the stage's public seed."""
    from vip_core.privacy.plan import PrivacyPlan
    from vip_core.train.schedule import Schedule
    from vip_core.train.step import PlainStep, PrivateStep

    options = dict(physical_batch_size=training.physical_batch_size, betas=training.betas,
                   weight_decay=training.weight_decay)
    if plan["private"]:
        return PrivateStep(model, PrivacyPlan.from_dict(plan["privacy"]), Schedule.of(training),
                           local_size=local_size, **options)
    return PlainStep(model, Schedule.of(training), seed=training.seed, local_size=local_size,
                     sample_rate=plan["sample_rate"], **options)


def restore_worker_run(run: WorkerRun, folder: str, rank: int, world: int) -> None:
    """Loads a reported checkpoint: weights, the step's state (ledger and plan checked), this rank's streams."""
    from vip_core.models.checkpoint import load_checkpoint

    payload = load_checkpoint(folder)
    run.model.load_state_dict(payload["model"])
    streams = payload["streams"][rank] if len(payload["streams"]) == world else None
    if streams is None:
        log.warning("checkpoint written by %d workers, now %d: fresh random streams", len(payload["streams"]), world)
    run.step.load_state_dict(payload["state"], streams)
    if run.ema is not None:
        if payload.get("ema") is None:
            raise ValueError(f"resume refused: the checkpoint in {folder} holds no EMA of the weights and the "
                             f"configuration asks for one (ema_decay {run.ema.decay}); choose a new output")
        run.ema.load_state_dict(payload["ema"])
    run.resumes = int(payload["resumes"]) + 1
    run.damaged = int(payload.get("damaged", 0)) if rank == 0 else 0  # the run's count so far, summed over ranks
    log.info("rank %d resumed at step %d (resume %d)", rank, run.step.taken, run.resumes)


def report_checkpoint(run: WorkerRun, report: StepReport | None, rank: int, world: int) -> None:
    """Reports a training checkpoint to Ray Train: rank 0 writes it with every rank's streams, after checking
    that every rank holds the same parameters."""
    import ray
    import ray.train

    check_parameters_equal(run.model)
    gathered = gather_objects({"streams": run.step.stream_state(), "node": ray.get_runtime_context().get_node_id()})
    peak_rss_mb = all_reduce_max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    summary = {
        **run.metrics(report, rank),
        "world_size": world, "nodes": len({g["node"] for g in gathered}),
        "resumes": run.resumes,
        "stopped_by_budget": run.step.taken < run.training.steps and not run.step.can_step(),
    }
    damaged = all_reduce_sum(run.damaged)
    if run.logs_private_statistics:  # all three follow the sampled images
        summary["peak_rss_mb"] = peak_rss_mb
        summary["damaged_images_skipped"] = int(damaged)
        if report is not None and run.seconds:
            summary["images_per_s"] = run.images / run.seconds
    if rank != 0:
        ray.train.report(summary)
        return
    from vip_core.models.checkpoint import save_checkpoint

    state = run.step.state_dict()
    with tempfile.TemporaryDirectory(prefix="vip-ckpt-") as folder:
        save_checkpoint(
            folder, model=run.model, config=run.config, stage=run.stage, step=run.step.taken, state=state,
            streams=[g["streams"] for g in gathered], resumes=run.resumes, damaged=int(damaged),
            ema=None if run.ema is None else run.ema.state_dict(),
        )
        ray.train.report(summary, checkpoint=ray.train.Checkpoint.from_directory(folder))


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
