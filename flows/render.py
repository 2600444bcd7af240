"""The rendering stage alone: synthetic images from procedural shader programs."""

from __future__ import annotations

from prefect import flow

from flows.caching import stage_folder
from flows.pipeline import default_workdir
from flows.stages import flow_tracking, render, run_fresh_if_missing
from tasks.runtime import tracking
from vip_core.config import VipConfig, tiny
from tasks.runtime.environment import configure_environment


@flow(name="vip-render", log_prints=True)
def render_flow(config: VipConfig = tiny(), workdir: str = "") -> dict:
    """Renders ``config.data.render`` into shards in ``<workdir>/render-<digest>``.

    Args:
        config: ``config.data.render`` drives this stage.
        workdir: empty: ``$VIP_HOME/runs/<config.name>``.
    """
    configure_environment()
    output = stage_folder(workdir or default_workdir(config), "render", config)
    with flow_tracking("vip-render", config) as parent:
        result = run_fresh_if_missing(render, output)(config, output, parent)
        tracking.log_result(parent, "render", result)
    return result
