"""The ingestion stage's own flow (``make ingest``): web images from a url list into clean shards."""

from __future__ import annotations

from prefect import flow

from flows.graph import log_stage_result, stage_graph
from vip_core.config import VipConfig, tiny


@flow(name="vip-ingest")
def ingest_flow(config: VipConfig = tiny(), url_list: str = "", eval_data: str = "", workdir: str = "") -> dict:
    """Downloads, filters, deduplicates and decontaminates ``url_list`` into ``<workdir>/ingest-<digest>``.

    Args:
        config: ``config.data.ingest`` drives this stage.
        url_list: a LAION-format parquet, csv or jsonl file of image URLs.
        eval_data: the evaluation data, whose images are removed from the web images; empty: none.
        workdir: empty: ``$VIP_HOME/runs/<config.name>``.
    """
    with stage_graph("vip-ingest", config, url_list=url_list, eval_data=eval_data, workdir=workdir) as graph:
        return log_stage_result(graph, "ingest", graph.ingest().result())
