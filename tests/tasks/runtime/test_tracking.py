"""MLflow tracking on a real store: stage runs nest under the flow's run, a retried stage continues its run,
the encoder is registered as an MLflow PyTorch model that loads back from the registry, with its privacy ledger."""

from __future__ import annotations

import json
import subprocess
import sys

import mlflow
import pytest
import torch

from tasks.runtime import tracking
from vip_core.config import flatten, tiny
from vip_core.models import build_mae, load_encoder, save_checkpoint


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


LEDGER = {"epsilon": 7.997, "delta": 1.6e-3, "noise_multiplier": 0.594, "sample_rate": 0.125, "steps": 10,
          "accountant": "pld", "composed_with": []}
LOAD_WITHOUT_VIP = """
import sys
import mlflow.pytorch, torch
sys.modules["vip_core"] = sys.modules["timm"] = None  # neither the project's code nor timm can be imported
encoder = mlflow.pytorch.load_model(sys.argv[1])
torch.save(encoder(torch.load(sys.argv[2])), sys.argv[3])
"""


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """``(checkpoint, version)``: a tiny MAE checkpoint (with a training loss beside the released entries),
    its encoder registered."""
    config = tiny()
    torch.manual_seed(0)
    checkpoint = save_checkpoint(tmp_path_factory.mktemp("final"), model=build_mae(config.model), config=config,
                                 step=10, ledger=LEDGER, loss=0.731)
    return checkpoint, tracking.register_encoder(tracking.start_run("vip-pipeline/registry"), checkpoint.parent)


def test_the_registered_encoder_loads_back_with_mlflow_and_gives_the_checkpoints_features(registered):
    checkpoint, version = registered
    images = torch.randn(3, 3, 32, 32)  # another batch size than the example's
    loaded = mlflow.pytorch.load_model(f"models:/{tracking.ENCODER_MODEL_NAME}/{version}")
    assert torch.allclose(loaded(images), load_encoder(checkpoint).eval()(images))
    info = mlflow.models.get_model_info(f"models:/{tracking.ENCODER_MODEL_NAME}/{version}")
    assert info.signature.inputs.to_dict()[0]["tensor-spec"]["shape"] == (-1, 3, 32, 32)


def test_the_registered_encoder_loads_without_the_projects_code(registered, tmp_path):
    checkpoint, version = registered
    images = torch.randn(2, 3, 32, 32)
    torch.save(images, tmp_path / "images.pt")
    subprocess.run([sys.executable, "-c", LOAD_WITHOUT_VIP, f"models:/{tracking.ENCODER_MODEL_NAME}/{version}",
                    str(tmp_path / "images.pt"), str(tmp_path / "features.pt")], check=True, cwd=tmp_path)
    assert torch.allclose(torch.load(tmp_path / "features.pt"), load_encoder(checkpoint).eval()(images))


def test_the_model_version_carries_the_privacy_ledger_and_no_other_private_value(registered):
    _, version = registered
    tags = tracking.client().get_model_version(tracking.ENCODER_MODEL_NAME, version).tags
    assert tags == {"privacy.epsilon": "7.997", "privacy.delta": "0.0016", "privacy.sigma": "0.594",
                    "privacy.q": "0.125", "privacy.steps": "10", "privacy.accountant": "pld"}
    metadata = mlflow.models.get_model_info(f"models:/{tracking.ENCODER_MODEL_NAME}/{version}").metadata
    assert set(metadata) == {"config", "step", "ledger"} and metadata["ledger"] == LEDGER
    assert "0.731" not in json.dumps(metadata), "the training loss stays out"



def test_the_model_version_is_a_logged_model_of_the_run_with_its_signature(registered):
    # MLflow's model-version page shows the schema of the version's logged model (empty without one)
    _, version = registered
    found = tracking.client().get_model_version(tracking.ENCODER_MODEL_NAME, version)
    assert found.source.startswith("models:/m-")
    logged = tracking.client().get_logged_model(found.source.removeprefix("models:/"))
    assert logged.source_run_id == found.run_id and str(logged.status) == "READY"
    info = mlflow.models.get_model_info(found.source)
    assert info.signature.outputs.to_dict()[0]["tensor-spec"]["shape"] == (-1, tiny().model.embed_dim)

def test_register_encoder_names_a_missing_checkpoint(tmp_path):
    run_id = tracking.start_run("vip-pipeline/missing")
    with pytest.raises(FileNotFoundError, match="checkpoint: no such file"):
        tracking.register_encoder(run_id, tmp_path / "nothing")


def test_the_step_logger_logs_every_step_without_the_step_waiting_for_a_slow_metric():
    import threading

    run_id = tracking.start_run("vip-pipeline/step-logger", config=tiny())
    released = threading.Event()
    logger = tracking.StepLogger(run_id, {"lr": "train/lr", "epsilon": "privacy/epsilon"})
    for step in (1, 2, 3):
        # the first ε cannot be computed until the steps are all given: a logger that computed it on the
        # caller's thread would never return from the first log
        wait = (lambda: released.wait(60) and 0.5) if step == 1 else (lambda step=step: step / 2)
        logger.log(step, {"lr": 0.1 * step, "not_named": 9.0}, {"epsilon": wait})
    released.set()
    logger.close()
    client = tracking.client()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "privacy/epsilon")] == [
        (1, 0.5), (2, 1.0), (3, 1.5)]
    assert [m.step for m in client.get_metric_history(run_id, "train/lr")] == [1, 2, 3]
    assert set(client.get_run(run_id).data.metrics) == {"train/lr", "privacy/epsilon"}
    tracking.end_run(run_id)


def test_a_step_logger_that_failed_says_so_on_the_next_step():
    logger = tracking.StepLogger("no-such-run", {"lr": "train/lr"})
    logger.log(1, {"lr": 0.1})
    with pytest.raises(RuntimeError, match="logging the step metrics to MLflow run no-such-run failed"):
        logger.flush()
    with pytest.raises(RuntimeError, match="no-such-run"):
        logger.close()
