"""The two pre-training stages' own flows (``make pretrain-syn``, ``make pretrain-dp``), each after the stages
it reads: a stage already done (by these flows or by the pipeline) is Cached."""

from __future__ import annotations

from prefect import flow

from flows.graph import log_stage_result, stage_graph
from tasks.runtime import tracking
from vip_core.config import VipConfig, tiny


@flow(name="vip-pretrain-syn")
def pretrain_syn_flow(config: VipConfig = tiny(), workdir: str = "") -> dict:
    """MAE pre-training on the render stage's images, without privacy (rendering them first if needed).

    Args:
        config: ``config.model`` and ``config.synthetic`` drive this stage (``config.data.render`` its input).
        workdir: empty: ``$VIP_HOME/runs/<config.name>``; the checkpoint goes to ``<workdir>/pretrain-syn-<digest>``.
    """
    with stage_graph("vip-pretrain-syn", config, workdir=workdir) as graph:
        return log_stage_result(graph, "pretrain-syn", graph.pretrain_syn().result())


@flow(name="vip-pretrain-dp")
def pretrain_dp_flow(config: VipConfig = tiny(), url_list: str = "", eval_data: str = "", workdir: str = "",
                     image_folder: str = "") -> dict:
    """Private MAE pre-training with DP-AdamW on the ingested web images, from the synthetic stage's weights
    (ingesting, rendering and pre-training on synthetic images first if needed); ε is logged at every step.

    Args:
        config: ``config.model``, ``config.private`` and ``config.privacy`` drive this stage.
        url_list: the private pre-training data: a LAION-format url list.
        eval_data: the evaluation data the web images are decontaminated against.
        workdir: empty: ``$VIP_HOME/runs/<config.name>``; the checkpoint goes to ``<workdir>/pretrain-dp-<digest>``.
        image_folder: a folder or fsspec URL of image files: the private data instead of ``url_list``.
    """
    with stage_graph("vip-pretrain-dp", config, url_list=url_list, eval_data=eval_data, workdir=workdir,
                     image_folder=image_folder) as graph:
        result = log_stage_result(graph, "pretrain-dp", graph.pretrain_dp().result())
        tracking.copy_history(result["mlflow_run_id"], graph.parent_run_id, "privacy/epsilon")
        return result
