"""``make reproduce``: the experiment of docs/reproduce.md as one Prefect flow, on the pipeline's real stages.

```
generators ──► downstream set per task (labelled, public) ───────────────────────────────────────┐
objects ──► private set per (DP arm, seed) ──────────────┐                                       │
render ──► pretrain-syn (seed) ──► checkpoint ──► pretrain-dp (dp-from-synthetic, vip-recipe) ──┐ │
           random weights (seed) ───────────────► pretrain-dp (dp-from-random) ─────────────────┴─┴► evaluate
                                                                                   (task, seed) ──► report
```
Findings fixed before running (``vip_core.reproduce.FINDINGS``), each judged per task: (1) synthetic MAE beats
random init; (2) DP warm-started from synthetic beats DP from random init at the same ε; (3) DP warm-started
from synthetic is at least as good as synthetic alone, within a margin of one point; (4) vip's recipe beats
the faithful one at the same ε and training compute; (5) DP from synthetic beats raw pixels. Each DP run
trains on its own private set, so each is (ε = 8, δ)-DP on its own data. The arms train once and are probed on
every task. The flow ends with the table (Markdown artifact ``vip-reproduce``), the plot (``reproduce.png``, in
the MLflow run and an image artifact) and a verdict per finding and task.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_image_artifact, create_markdown_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from flows.stages import flow_tracking, pretrain, render
from tasks.runtime import tracking
from tasks.runtime.environment import state_paths
from vip_core.reproduce import PRIVATE_ARMS, WARM_STARTED, ReproduceConfig, reproduce

FLOW_NAME = "vip-reproduce"
TRAINING_THREADS = 2  # two trainings side by side (one CPU each on this 2-core machine)
PRIVACY_KEYS = ("epsilon", "delta", "noise_multiplier", "steps", "dataset_size", "sample_rate")


@task(name="private-set", task_run_name="private-set-{arm}-seed{seed}", retries=1)
def private_set(output: str, count: int, data_seed: int, arm: str, seed: int) -> dict:
    """The private images of one (arm, seed): unlabelled objects on the photographs' private region."""
    from tasks.stages.reproduce import write_private_set

    return write_private_set(output, count, data_seed)


@task(name="downstream-set", task_run_name="downstream-set-{task_name}", retries=1)
def downstream_set(output: str, task_name: str, experiment: ReproduceConfig) -> dict:
    """One task's labelled downstream set (public evaluation data)."""
    from tasks.stages.reproduce import write_downstream_set

    task = next(task for task in experiment.tasks if task.name == task_name)
    return write_downstream_set(output, task, experiment.downstream_train, experiment.downstream_test,
                                experiment.vip.model.img_size)


@task(name="evaluate-arms", task_run_name="evaluate-{task_name}-seed{seed}", retries=1)
def evaluate_arms(experiment: ReproduceConfig, task_name: str, seed: int | None, checkpoints: dict[str, str],
                  data: str, output: str) -> dict:
    """The converged probe on every arm of one seed (None: the raw pixels) on one task."""
    from tasks.stages.reproduce import evaluate_seed

    return evaluate_seed(experiment, seed, checkpoints, data, output)


@task(name="report", task_run_name="report")
def report(experiment: ReproduceConfig, evaluations: dict[str, list[dict]], privacy: list[dict], output: str) -> dict:
    """The verdicts per task, the table and the plot."""
    from tasks.stages.reproduce import write_report

    return write_report(experiment, evaluations, privacy, output)


@flow(name=FLOW_NAME, task_runner=ThreadPoolTaskRunner(max_workers=TRAINING_THREADS))
def reproduce_flow(experiment: ReproduceConfig = reproduce(), workdir: str = "") -> dict:
    """Does DP pre-training from synthetic images give useful features? Every arm, every seed, every task of the
    experiment's split, then the verdicts.

    Args:
        experiment: the sizes, seeds and model (``experiment.vip``); the findings are fixed in the code.
        workdir: where the data, runs and report go; empty: ``$VIP_HOME/runs/<experiment.name>``. It holds one
            experiment: its stages resume there, and a workdir holding another experiment's runs is refused.
    """
    from tasks.stages.reproduce import claim_workdir

    started = time.perf_counter()
    root = Path(workdir) if workdir else state_paths()["runs"] / experiment.name
    claim_workdir(root, experiment)
    with flow_tracking(FLOW_NAME, experiment.vip) as parent:
        downstream = {task.name: downstream_set.submit(str(root / f"downstream-{task.name}"), task.name, experiment)
                      for task in experiment.tasks}
        trained = _train_arms(experiment, root, parent)
        evaluations = {name: [evaluate_arms.submit(experiment, name, seed, trained["checkpoints"].get(seed, {}),
                                                   data.result()["output"], str(root / f"eval-{name}-seed{seed}"))
                              for seed in (None, *experiment.seeds)]
                       for name, data in downstream.items()}
        result = report.submit(experiment, {name: [e.result() for e in futures] for name, futures in evaluations.items()},
                               trained["privacy"], str(root / "report")).result()
        result["seconds"] = round(time.perf_counter() - started, 1)
        _publish(parent, result)
    return result


def _train_arms(experiment: ReproduceConfig, root: Path, parent: str) -> dict[str, Any]:
    """Submits the data, then every training run, in an order where a task only waits on tasks already running
    (the warm-started runs last); returns the checkpoints per seed and the privacy of each private run."""
    from tasks.runtime.ray_session import ray_session

    private_arms = [arm for arm in PRIVATE_ARMS if arm in experiment.arms]
    rendered = render.submit(experiment.vip, str(root / "render"), parent)
    data = {(arm, seed): private_set.submit(str(root / f"private-{arm}-seed{seed}"), experiment.private_images,
                                            experiment.private_set_seed(arm, seed), arm, seed)
            for arm in private_arms for seed in experiment.seeds}
    runs: dict[tuple[str, int], tuple[Any, str]] = {}

    def submit(arm: str, seed: int, stage: str, config, inputs: str, warm: str | None, wait_for: list) -> None:
        mlflow_run = tracking.start_run(f"{arm}-seed{seed}", parent_run_id=parent,
                                        tags={tracking.STAGE_TAG: "reproduce/arm"})
        future = pretrain.submit(config, stage, inputs, str(root / f"{arm}-seed{seed}"), warm, mlflow_run,
                                 wait_for=wait_for)
        runs[arm, seed] = (future, mlflow_run)

    training = experiment.vip.synthetic, experiment.vip.private
    with ray_session(max(t.num_workers for t in training), max(t.cpus_per_worker for t in training)):
        for seed in experiment.seeds:
            submit("synthetic", seed, "synthetic", experiment.seeded(seed), str(root / "render"), None, [rendered])
        for arm in sorted(private_arms, key=lambda arm: arm in WARM_STARTED):
            for seed in experiment.seeds:
                warm = runs["synthetic", seed][0].result()["checkpoint"] if arm in WARM_STARTED else None
                submit(arm, seed, "private", experiment.arm_config(arm, seed), data[arm, seed].result()["output"],
                       warm, [])
        results = {key: _finished(future, mlflow_run) for key, (future, mlflow_run) in runs.items()}
    checkpoints = {seed: {arm: results[arm, s]["checkpoint"] for arm, s in results if s == seed}
                   for seed in experiment.seeds}
    privacy = [{"arm": arm, "seed": seed, **{k: results[arm, seed].get(k) for k in PRIVACY_KEYS}}
               for arm, seed in results if arm in PRIVATE_ARMS]
    return {"checkpoints": checkpoints, "privacy": privacy}


def _finished(future: Any, mlflow_run: str) -> dict[str, Any]:
    """The training run's result; its (arm, seed) MLflow run ends FINISHED, or FAILED when it failed."""
    try:
        result = future.result()
    except BaseException:
        tracking.end_run(mlflow_run, "FAILED")
        raise
    tracking.end_run(mlflow_run)
    return result


def _publish(parent: str, result: dict[str, Any]) -> None:
    """The results as single-value metrics (``reproduce.<task>.<arm>.top1``, see tracking.log_summary) and
    ``reproduce.json``, the plot and table as artifacts of the flow's MLflow run, and the table and plot as
    Prefect artifacts."""
    bounds = (("mean", ""), ("low", "_ci_low"), ("high", "_ci_high"))
    metrics, verdicts = {}, {}
    for name, task in result["tasks"].items():
        metrics.update({f"reproduce/{name}/{arm}/top1{suffix}": value[key] for arm, value in task["arms"].items()
                        for key, suffix in bounds})
        metrics.update({f"reproduce/{name}/finding{f['number']}/difference{suffix}": f["difference"][key]
                        for f in task["findings"] for key, suffix in bounds})
        verdicts.update({f"reproduce.{name}.finding{f['number']}": f["verdict"] for f in task["findings"]})
    metrics.update({f"reproduce/{arm}/flops": flops for arm, flops in result["compute"].items()})
    tracking.log_summary(parent, {**metrics, "reproduce/seconds": result["seconds"]})
    tracking.client().log_dict(parent, result, "reproduce.json")
    tracking.log_artifact(parent, result["plot"])
    tracking.log_artifact(parent, result["table_file"])
    tracking.set_tags(parent, verdicts)
    create_markdown_artifact(result["table"] + f"\n\nWall clock: {result['seconds'] / 60:.1f} min.",
                             key="vip-reproduce", description="make reproduce: table and verdicts")
    create_image_artifact(f"{tracking.ui_base_url()}/get-artifact?path=reproduce.png&run_uuid={parent}",
                          key="vip-reproduce-plot", description="make reproduce: the plot (served by the MLflow UI)")
