"""The flow each make target runs: ``make run`` the pipeline, ``make <stage>`` the stage's own flow.

The keys are ``run`` and the stage names of ``tasks.runtime.names.STAGES``, the list the Makefile reads.
"""

from __future__ import annotations

from prefect import Flow

from flows.audit import audit_flow
from flows.eval import eval_flow
from flows.ingest import ingest_flow
from flows.pipeline import vip_pipeline
from flows.pretrain import pretrain_dp_flow, pretrain_syn_flow
from flows.render import render_flow

FLOWS: dict[str, Flow] = {
    "run": vip_pipeline,
    "ingest": ingest_flow,
    "render": render_flow,
    "pretrain-syn": pretrain_syn_flow,
    "pretrain-dp": pretrain_dp_flow,
    "eval": eval_flow,
    "audit": audit_flow,
}
