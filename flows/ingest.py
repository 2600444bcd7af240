"""The ingestion stage alone: web images from a url list into clean shards."""

from __future__ import annotations

from prefect import flow

from flows.caching import stage_folder
from flows.pipeline import default_workdir
from flows.stages import flow_tracking, ingest, run_fresh_if_missing
from tasks.runtime import tracking
from vip_core.config import VipConfig, tiny
from tasks.runtime.environment import configure_environment


@flow(name="vip-ingest", log_prints=True)
def ingest_flow(config: VipConfig = tiny(), url_list: str = "", eval_images: str = "", workdir: str = "") -> dict:
    """Downloads, filters, deduplicates and decontaminates ``url_list``.

    Args:
        config: ``config.data.ingest`` drives this stage.
        url_list: a LAION-format parquet, csv or jsonl file of image URLs.
        eval_images: a folder of evaluation images to decontaminate against; empty: none.
        workdir: empty: ``$VIP_HOME/runs/<config.name>``; the shards go to ``<workdir>/ingest-<digest>``.
    """
    configure_environment()
    output = stage_folder(workdir or default_workdir(config), "ingest", config, inputs=(url_list, eval_images))
    with flow_tracking("vip-ingest", config) as parent:
        result = run_fresh_if_missing(ingest, output)(config, url_list, output, eval_images or None, parent)
        tracking.log_result(parent, "ingest", result)
    return result
