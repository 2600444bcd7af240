"""The end-to-end flow (``make run``): ingest and render, pre-train on synthetic images, pre-train privately,
audit, evaluate, register the encoder.

```
url list ──► ingest ─────────────────────────────────┐
render ──► pretrain-syn (MAE, no DP) ──► checkpoint ──► pretrain-dp (DP-AdamW) ──► eval.map(tasks)
                                                                    audit (canaries) ┘ └─► register the encoder
```
Ingest and render run side by side; the evaluation jobs run in parallel, each beside the same job on a
randomly initialised encoder (its baseline), and so does the privacy audit of the private recipe. The
stages are those of :class:`flows.graph.StageGraph`, shared with each stage's own flow: every stage
writes to ``<workdir>/<stage>-<config digest>`` and is cached, here and there.
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from flows.graph import AUDIT_CANARIES, AUDIT_DELTA, EVAL_THREADS, stage_graph
from tasks.runtime import results, tracking
from vip_core.config import VipConfig, tiny

FLOW_NAME = "vip-pipeline"


@flow(name=FLOW_NAME, task_runner=ThreadPoolTaskRunner(max_workers=EVAL_THREADS))
def vip_pipeline(
    config: VipConfig = tiny(), url_list: str = "", eval_data: str = "", workdir: str = "",
    audit_canaries: int = AUDIT_CANARIES, audit_delta: float = AUDIT_DELTA, image_folder: str = "",
) -> dict:
    """The whole ViP pipeline on one config.

    Args:
        config: the run's configuration (model, privacy, data, both pre-training stages, evaluation).
        url_list: a LAION-format parquet, csv or jsonl file of image URLs: the private pre-training data.
        eval_data: a folder or fsspec URL (``s3://bucket/eval``) with ``classification/`` (ImageFolder), ``coco/``
            and ``ade20k/``; public data, also used to decontaminate the web images.
        workdir: where the stages write; empty: ``$VIP_HOME/runs/<config.name>``.
        audit_canaries: canaries of the privacy audit run beside the evaluations; 0: no audit.
        audit_delta: the δ the audit's recipe is calibrated at (its bound loses power as 2·canaries·δ grows,
            so a small one rather than 1/(2N) of a small data set).
        image_folder: a folder or fsspec URL of image files: the private pre-training data instead of ``url_list``.
    """
    with stage_graph(FLOW_NAME, config, url_list=url_list, eval_data=eval_data, workdir=workdir,
                     image_folder=image_folder) as graph:
        graph.pretrain_dp().wait()  # the audit starts after the training stages, beside the evaluations
        audited = graph.audit(audit_canaries, audit_delta) if audit_canaries else None
        registered = graph.register_encoder()
        evaluations = graph.evaluations()
        summary = results.summarize(
            config=config, flow_run_id=str(flow_run.id), mlflow_run_id=graph.parent_run_id, workdir=graph.workdir,
            ingest=graph.ingest().result(), render=graph.render().result(), pretrain_syn=graph.pretrain_syn().result(),
            pretrain_dp=graph.pretrain_dp().result(), evaluations=evaluations, registered_model=registered.result(),
            audit=audited.result() if audited else None,
        )
        tracking.copy_history(graph.pretrain_dp().result()["mlflow_run_id"], graph.parent_run_id, "privacy/epsilon")
        tracking.log_summary(graph.parent_run_id, results.summary_metrics(summary))
        tracking.client().log_dict(graph.parent_run_id, summary, "results.json")
        create_markdown_artifact(results.markdown_table(summary), key="vip-results", description="ViP results")
    return summary
