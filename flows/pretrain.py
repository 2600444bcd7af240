"""The two pre-training stages alone: on synthetic images (no privacy), then privately on web images."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.caching import stage_folder
from flows.pipeline import default_workdir
from flows.stages import flow_tracking, local_ray, pretrain, run_fresh_if_missing
from tasks.runtime import tracking
from vip_core.config import VipConfig, tiny
from tasks.runtime.environment import configure_environment


@flow(name="vip-pretrain-syn", log_prints=True)
def pretrain_syn_flow(config: VipConfig = tiny(), data: str = "", workdir: str = "") -> dict:
    """MAE pre-training on synthetic shards, without privacy.

    Args:
        config: ``config.model`` and ``config.synthetic`` drive this stage.
        data: the synthetic shards; empty: the render stage's folder under ``workdir``.
        workdir: empty: ``$VIP_HOME/runs/<config.name>``; the checkpoint goes to ``<workdir>/pretrain-syn-<digest>``.
    """
    configure_environment()
    workdir = workdir or default_workdir(config)
    data = data or stage_folder(workdir, "render", config)
    output = stage_folder(workdir, "pretrain-syn", config, inputs=(data,))
    with flow_tracking("vip-pretrain-syn", config) as parent, local_ray(config):
        result = run_fresh_if_missing(pretrain, output)(config, "synthetic", data, output, None, parent)
        tracking.log_result(parent, "pretrain-syn", result)
    return result


@flow(name="vip-pretrain-dp", log_prints=True)
def pretrain_dp_flow(config: VipConfig = tiny(), data: str = "", init_checkpoint: str = "", workdir: str = "") -> dict:
    """Private MAE pre-training with DP-AdamW on web shards; ε is logged at every step.

    Args:
        config: ``config.model``, ``config.private`` and ``config.privacy`` drive this stage.
        data: the web shards (the ingest stage's output folder).
        init_checkpoint: where to start; empty: the synthetic stage's checkpoint under ``workdir`` (from
            the render stage's images) if there is one, else a random initialisation.
        workdir: empty: ``$VIP_HOME/runs/<config.name>``; the checkpoint goes to ``<workdir>/pretrain-dp-<digest>``.
    """
    configure_environment()
    workdir = workdir or default_workdir(config)
    synthetic = stage_folder(workdir, "pretrain-syn", config, inputs=(stage_folder(workdir, "render", config),))
    init_checkpoint = init_checkpoint or _existing(synthetic)
    output = stage_folder(workdir, "pretrain-dp", config, inputs=(data, init_checkpoint))
    with flow_tracking("vip-pretrain-dp", config) as parent, local_ray(config):
        result = run_fresh_if_missing(pretrain, output)(config, "private", data, output, init_checkpoint, parent)
        tracking.log_result(parent, "pretrain-dp", result)
        tracking.log_metrics(parent, {"privacy/epsilon": result["epsilon"]}, step=result["steps"])
    return result


def _existing(folder: str) -> str | None:
    return folder if (Path(folder) / "checkpoint.pt").exists() else None
