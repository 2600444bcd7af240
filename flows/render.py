"""The render stage's own flow (``make render``): synthetic images from procedural shader programs."""

from __future__ import annotations

from prefect import flow

from flows.graph import log_stage_result, stage_graph
from vip_core.config import VipConfig, tiny


@flow(name="vip-render")
def render_flow(config: VipConfig = tiny(), workdir: str = "") -> dict:
    """Renders ``config.data.render`` into shards in ``<workdir>/render-<digest>``, as the pipeline does.

    Args:
        config: ``config.data.render`` drives this stage.
        workdir: empty: ``$VIP_HOME/runs/<config.name>``.
    """
    with stage_graph("vip-render", config, workdir=workdir) as graph:
        return log_stage_result(graph, "render", graph.render().result())
