"""MLflow tracking on a real store: stage runs nest under the flow's run, a retried stage continues its run,
the encoder is registered as a model version that downloads."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

from tasks.runtime import tracking
from vip_core.config import flatten, tiny


def test_a_stage_run_is_a_child_of_the_flow_run_with_the_flattened_config_as_params():
    config = tiny()
    parent = tracking.start_run("vip-pipeline/test", config=config, tags={tracking.FLOW_RUN_TAG: "flow-run-1"})
    with tracking.stage_run(parent, "render", config) as child:
        tracking.log_result(child, "render", {"images": 256, "skipped": {"blank": 3}, "output": "/x"})
    tracking.end_run(parent)

    client = tracking.client()
    child_run = client.get_run(child)
    assert child_run.data.tags[tracking.PARENT_TAG] == parent
    assert child_run.data.tags[tracking.STAGE_TAG] == "render"
    assert child_run.info.status == "FINISHED"
    assert child_run.data.params == flatten(config)
    assert child_run.data.metrics == {"render.images": 256.0, "render.skipped.blank": 3.0}
    assert [(m.step, m.value) for m in client.get_metric_history(child, "render.images")] == [(0, 256.0)]
    assert {a.path for a in client.list_artifacts(child)} == {"config.json", "render.json"}
    assert client.get_run(parent).data.tags[tracking.FLOW_RUN_TAG] == "flow-run-1"
    assert [run.info.run_id for run in tracking.child_runs(parent)] == [child]


def test_the_experiment_and_the_links_open_the_model_training_view():
    experiment = tracking.client().get_experiment(tracking.experiment_id())
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    run_id = tracking.start_run("vip-pipeline/links")
    tracking.end_run(run_id)
    base = "http://127.0.0.1:5999"
    assert tracking.run_ui_url(run_id, base) == (
        f"{base}/#/experiments/{experiment.experiment_id}/runs/{run_id}?workflowType=machine_learning")
    assert tracking.run_ui_url(run_id, base, tab="model-metrics") == (
        f"{base}/#/experiments/{experiment.experiment_id}/runs/{run_id}/model-metrics?workflowType=machine_learning")
    assert tracking.experiment_ui_url(base) == f"{base}/#/experiments/{experiment.experiment_id}?workflowType=machine_learning"
    assert tracking.model_ui_url("vip-encoder", "3", base) == f"{base}/#/models/vip-encoder/versions/3?workflowType=machine_learning"


def test_an_experiment_made_before_the_tag_gets_it():
    client = tracking.client()
    client.create_experiment("vip-untagged")
    assert "mlflow.experimentKind" not in client.get_experiment_by_name("vip-untagged").tags
    tagged = client.get_experiment(tracking.experiment_id("vip-untagged"))
    assert tagged.tags["mlflow.experimentKind"] == "custom_model_development"


def test_the_flow_run_charts_the_private_stage_epsilon_over_its_steps():
    parent = tracking.start_run("vip-pipeline/history")
    with tracking.stage_run(parent, "pretrain-dp", tiny()) as child:
        for step, epsilon in enumerate((0.5, 0.9, 1.2), start=1):
            tracking.log_metrics(child, {"privacy/epsilon": epsilon}, step=step)
    tracking.copy_history(child, parent, "privacy/epsilon")
    tracking.copy_history(child, parent, "privacy/epsilon")  # a retried flow copies it again
    history = tracking.client().get_metric_history(parent, "privacy/epsilon")
    assert [(metric.step, metric.value) for metric in history] == [(1, 0.5), (2, 0.9), (3, 1.2)]


def test_a_retried_stage_continues_its_failed_run():
    config = tiny()
    parent = tracking.start_run("vip-pipeline/retry", config=config)
    with pytest.raises(RuntimeError, match="worker lost"):
        with tracking.stage_run(parent, "pretrain-dp", config) as first:
            tracking.log_metrics(first, {"privacy/epsilon": 1.5}, step=1)
            raise RuntimeError("worker lost")
    assert tracking.client().get_run(first).info.status == "FAILED"

    with tracking.stage_run(parent, "pretrain-dp", config) as second:
        tracking.log_metrics(second, {"privacy/epsilon": 2.5}, step=2)

    assert second == first
    history = tracking.client().get_metric_history(second, "privacy/epsilon")
    assert [(m.step, m.value) for m in history] == [(1, 1.5), (2, 2.5)]
    assert tracking.client().get_run(second).info.status == "FINISHED"


def test_register_encoder_makes_a_downloadable_model_version(tmp_path):
    checkpoint = tmp_path / "final"
    checkpoint.mkdir()
    (checkpoint / "checkpoint.pt").write_bytes(b"weights")
    run_id = tracking.start_run("vip-pipeline/registry")
    first = tracking.register_encoder(run_id, checkpoint)
    second = tracking.register_encoder(run_id, checkpoint / "checkpoint.pt")
    assert int(second) == int(first) + 1
    folder = mlflow.artifacts.download_artifacts(f"models:/{tracking.ENCODER_MODEL_NAME}/{first}")
    assert (Path(folder) / "checkpoint.pt").read_bytes() == b"weights"


def test_register_encoder_names_a_missing_checkpoint(tmp_path):
    run_id = tracking.start_run("vip-pipeline/missing")
    with pytest.raises(FileNotFoundError, match="checkpoint: no such file"):
        tracking.register_encoder(run_id, tmp_path / "nothing")
