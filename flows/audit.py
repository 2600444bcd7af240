"""The privacy audit's own flow (``make audit``): an empirical lower bound on ε of the private recipe."""

from __future__ import annotations

from prefect import flow

from flows.graph import AUDIT_CANARIES, AUDIT_DELTA, log_stage_result, stage_graph
from vip_core.config import VipConfig, tiny


@flow(name="vip-audit")
def audit_flow(config: VipConfig = tiny(), audit_canaries: int = AUDIT_CANARIES, audit_delta: float = AUDIT_DELTA,
               workdir: str = "") -> dict:
    """Trains the private recipe with canaries and proves a lower bound on ε from them, as the pipeline does.

    Args:
        config: ``config.model``, ``config.private`` and ``config.privacy`` give the recipe.
        audit_canaries: the number of canaries.
        audit_delta: the δ the recipe is calibrated at (the bound loses power as 2·canaries·δ grows).
        workdir: empty: ``$VIP_HOME/runs/<config.name>``; the result goes to ``<workdir>/audit-<digest>-m<canaries>``.
    """
    with stage_graph("vip-audit", config, workdir=workdir) as graph:
        return log_stage_result(graph, "audit", graph.audit(audit_canaries, audit_delta).result())
