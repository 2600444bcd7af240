"""The ingestion stage's own flow (``make ingest``): web images from a url list, or image files from a folder or
bucket (``make ingest INPUT=...``), into clean shards."""

from __future__ import annotations

from prefect import flow

from flows.graph import log_stage_result, stage_graph
from vip_core.config import VipConfig, tiny


@flow(name="vip-ingest")
def ingest_flow(config: VipConfig = tiny(), url_list: str = "", eval_data: str = "", workdir: str = "",
                image_folder: str = "") -> dict:
    """Downloads (or reads), filters, deduplicates and decontaminates the private images into
    ``<workdir>/ingest-<digest>``.

    Args:
        config: ``config.data.ingest`` drives this stage.
        url_list: a LAION-format parquet, csv or jsonl file of image URLs.
        eval_data: the evaluation data, whose images are removed from the private ones; empty: none.
        workdir: empty: ``$VIP_HOME/runs/<config.name>``.
        image_folder: a folder or fsspec URL of image files, read instead of ``url_list``.
    """
    with stage_graph("vip-ingest", config, url_list=url_list, eval_data=eval_data, workdir=workdir,
                     image_folder=image_folder) as graph:
        return log_stage_result(graph, "ingest", graph.ingest().result())
