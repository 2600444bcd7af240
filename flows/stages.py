"""The pipeline's stages as Prefect tasks, and the MLflow parent run of a flow run.

Each task runs one stage function from ``tasks/`` inside the stage's MLflow child run and returns the
stage's small result dict. Flows submit them through :class:`flows.graph.StageGraph`. Tasks retry on failure (the stage functions resume the work already written)
and cache their result under a key made of their config slice and inputs (:mod:`flows.caching`), in
Prefect's result store under ``$PREFECT_HOME``: a second run with the same config skips them.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

from prefect import task
from prefect.artifacts import create_link_artifact
from prefect.runtime import flow_run, task_run
from prefect.utilities.annotations import quote

from flows.caching import eval_stage, stage_cache_key
from tasks.runtime.folders import digest, fingerprint
from tasks.runtime import tracking
from tasks.runtime.names import PRETRAIN_STAGES
from vip_core.config import VipConfig


def _options(stage: Any, retries: int, retry_delay_seconds: float) -> dict[str, Any]:
    return dict(
        cache_key_fn=stage_cache_key(stage),
        persist_result=True,
        retries=retries,
        retry_delay_seconds=retry_delay_seconds,
    )


@task(name="ingest", task_run_name="ingest", **_options("ingest", retries=2, retry_delay_seconds=10))
def ingest(config: VipConfig, url_list: str, output: str, eval_images: str | None, parent_run_id: str | None,
           image_folder: str = "") -> dict:
    """The private images: download the url list (or read the image folder), filter, deduplicate, decontaminate
    against ``eval_images``."""
    from tasks.stages.ingest import run_ingest, run_ingest_images

    with tracking.stage_run(parent_run_id, "ingest", config) as run_id:
        if image_folder:
            stats = run_ingest_images(config, image_folder, output, eval_images=eval_images)
        else:
            stats = run_ingest(config, url_list, output, eval_images=eval_images)
        tracking.log_result(run_id, "ingest", stats)
    return stats


@task(name="render", task_run_name="render", **_options("render", retries=1, retry_delay_seconds=5))
def render(config: VipConfig, output: str, parent_run_id: str | None) -> dict:
    """Synthetic images rendered from the procedural shader programs."""
    from tasks.stages.render import run_render

    with tracking.stage_run(parent_run_id, "render", config) as run_id:
        stats = in_fresh_process(run_render, config, output)
        tracking.log_result(run_id, "render", stats)
    return stats


def in_fresh_process(function: Callable[..., dict], *args: Any) -> dict:
    """``function(*args)`` in a new (spawned) Python process; returns its result.

    The renderer loads Mesa's llvmpipe (LLVM) into its process, and importing torchvision (Triton, with
    its own LLVM) into a process that holds it crashes that process: the GL stage runs apart from the
    flow, which goes on to train and evaluate.
    """
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def _pretrain_stage_name() -> str:
    """``pretrain-syn`` or ``pretrain-dp``: the run name of a pre-training task run (whose parameters the graph
    quotes, :func:`flows.graph._submit`)."""
    stage = task_run.parameters["stage"]
    return PRETRAIN_STAGES[stage.unquote() if isinstance(stage, quote) else stage]


@task(
    name="pretrain",
    task_run_name=_pretrain_stage_name,
    **_options(lambda parameters: PRETRAIN_STAGES[parameters["stage"]], retries=1, retry_delay_seconds=5),
)
def pretrain(
    config: VipConfig, stage: str, data: str, output: str, init_checkpoint: str | None, parent_run_id: str | None
) -> dict:
    """MAE pre-training: ``synthetic`` (no privacy) or ``private`` (DP-AdamW; ε logged at every step).

    A retry resumes from the stage's last checkpoint and continues its privacy ledger.
    """
    from tasks.stages.pretrain import run_pretrain

    name = PRETRAIN_STAGES[stage]
    with tracking.stage_run(parent_run_id, name, config) as run_id:
        result = run_pretrain(
            config, stage, data, output, init_checkpoint=init_checkpoint, resume=True, mlflow_run_id=run_id
        )
        tracking.log_result(run_id, name, result)
        tracking.log_artifact(run_id, _checkpoint_file(result["checkpoint"]), "checkpoint")
    return result


@task(name="eval", task_run_name="eval-{name}", **_options(eval_stage, retries=1, retry_delay_seconds=5))
def evaluate(config: VipConfig, task: str, name: str, checkpoint: str, data: str, output: str,
             parent_run_id: str | None) -> dict:
    """One pair of the evaluation suite (``task`` on ``data``, called ``name``) on the encoder of ``checkpoint``,
    beside the same job on a random-init encoder when the config asks.

    The job logs its own child run (``eval-<name>``) under ``parent_run_id``; a retry resumes what it wrote.
    """
    from tasks.stages.eval import run_evaluation

    return run_evaluation(config, task, checkpoint, data, output, mlflow_run_id=parent_run_id, name=name)


@task(name="audit", task_run_name="audit", **_options("audit", retries=1, retry_delay_seconds=5))
def audit(config: VipConfig, canaries: int, output: str, parent_run_id: str | None) -> dict:
    """The privacy audit of the private training recipe: an empirical lower bound on ε from canaries."""
    from tasks.stages.audit import run_audit

    with tracking.stage_run(parent_run_id, "audit", config) as run_id:
        return run_audit(config, canaries, output, mlflow_run_id=run_id)


@task(
    name="register-encoder",
    task_run_name="register-encoder",
    cache_key_fn=lambda context, parameters: f"vip-register-{digest(fingerprint(parameters['checkpoint']))}",
    persist_result=True,
    retries=2,
    retry_delay_seconds=2,
)
def register_encoder(checkpoint: str, parent_run_id: str) -> str:
    """Registers the final encoder in the MLflow model registry, once per checkpoint; returns ``name/version``."""
    version = tracking.register_encoder(parent_run_id, checkpoint)
    return f"{tracking.ENCODER_MODEL_NAME}/{version}"


@contextlib.contextmanager
def flow_tracking(flow_name: str, config: VipConfig) -> Iterator[str]:
    """The MLflow parent run of the current Prefect flow run, tagged with its id, open for the block.

    A link to the run appears among the flow run's artifacts in the Prefect UI.
    """
    tags = {
        tracking.FLOW_RUN_TAG: str(flow_run.id),
        "prefect.flow_run_name": str(flow_run.name),
        "prefect.flow_name": flow_name,
    }
    with tracking.run(f"{flow_name}/{flow_run.name}", config=config, tags=tags) as run_id:
        create_link_artifact(
            tracking.run_ui_url(run_id), link_text="MLflow run", key="mlflow-run",
            description=f"MLflow parent run {run_id} of this flow run",
        )
        yield run_id


def _checkpoint_file(checkpoint: str) -> str:
    path = Path(checkpoint)
    return str(path / "checkpoint.pt") if path.is_dir() else str(path)
