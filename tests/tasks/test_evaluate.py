"""run_evaluation and ``vip evaluate``: every job end to end on the tiny preset with a saved checkpoint,
metrics.json with the result and the random-init baseline, the MLflow child run, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.demo_data import make_ade20k_shapes, make_coco_shapes, make_digits_imagefolder
from tasks.evaluate import METRICS_FILE, run_evaluation
from vip_core.config import tiny
from vip_core.models import build_mae, save_checkpoint

DATA = {"linprobe": "digits", "finetune": "digits", "fewshot": "digits", "coco": "coco", "ade20k": "ade20k"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    make_digits_imagefolder(root / "digits", img_size=32, per_class=30)
    make_coco_shapes(root / "coco", img_size=32, n=12)
    make_ade20k_shapes(root / "ade20k", img_size=32, n=12)
    config = tiny()
    torch.manual_seed(0)
    checkpoint = save_checkpoint(root / "run", model=build_mae(config.model), config=config, stage="private", step=0)
    return root, config, checkpoint


@pytest.fixture(scope="module")
def evaluations(workspace):
    root, config, checkpoint = workspace
    return {task: run_evaluation(config, task, str(checkpoint), str(root / data), str(root / "out" / task))
            for task, data in DATA.items()}


def _in_unit_interval(metrics: dict, names: tuple[str, ...]) -> bool:
    return all(0.0 <= metrics[name] <= 1.0 for name in names)


def test_every_job_writes_metrics_json_with_result_and_random_init_baseline(workspace, evaluations):
    root, _, checkpoint = workspace
    for task, metrics in evaluations.items():
        stored = json.loads((root / "out" / task / METRICS_FILE).read_text())
        assert stored == metrics
        assert stored["task"] == task and stored["checkpoint"] == str(checkpoint)
        assert stored["result"] and stored["baseline"], task
        assert set(stored["result"]) == set(stored["baseline"]), task


def test_linear_probe_and_few_shot_beat_chance_for_both_encoders(evaluations):
    for role in ("result", "baseline"):
        probe = evaluations["linprobe"][role]
        assert probe["top1"] >= 2 * probe["chance_top1"], (role, probe)
        shots = evaluations["fewshot"][role]
        assert shots["10shot_top1"] > shots["1shot_top1"] and shots["10shot_top1"] >= 0.2, (role, shots)


def test_finetune_detection_and_segmentation_report_numbers_in_range(evaluations):
    for role in ("result", "baseline"):
        assert _in_unit_interval(evaluations["finetune"][role], ("top1", "top5"))
        assert _in_unit_interval(evaluations["coco"][role], ("ap_box", "ap50_box", "ap_mask", "ap50_mask"))
        segmentation = evaluations["ade20k"][role]
        assert _in_unit_interval(segmentation, ("miou", "pixel_accuracy")) and segmentation["num_classes"] == 4


def test_running_again_with_the_same_inputs_returns_the_stored_metrics(workspace, evaluations):
    root, config, checkpoint = workspace
    output = root / "out" / "linprobe"
    before = (output / METRICS_FILE).stat().st_mtime_ns
    again = run_evaluation(config, "linprobe", str(checkpoint), str(root / "digits"), str(output))
    assert again == evaluations["linprobe"] and (output / METRICS_FILE).stat().st_mtime_ns == before


def test_child_run_under_the_parent_holds_result_and_baseline_metrics(workspace, evaluations):
    from tasks import tracking

    root, config, checkpoint = workspace
    parent = tracking.start_run("pipeline-under-test")
    metrics = run_evaluation(config, "ade20k", str(checkpoint), str(root / "ade20k"), str(root / "out" / "ade20k"),
                             mlflow_run_id=parent)
    assert metrics == evaluations["ade20k"], "stored metrics are reused and still logged"
    (child,) = tracking.child_runs(parent)
    assert child.data.tags["mlflow.parentRunId"] == parent and child.info.status == "FINISHED"
    logged = child.data.metrics
    assert logged["eval/ade20k/miou"] == pytest.approx(metrics["result"]["miou"])
    assert logged["eval/ade20k/miou_random_init"] == pytest.approx(metrics["baseline"]["miou"])
    artifacts = [entry.path for entry in tracking.client().list_artifacts(child.info.run_id)]
    assert METRICS_FILE in artifacts


def _vip(capsys, *args: str) -> tuple[int, str, str]:
    """``vip ARGS`` through the entry point in this process: (exit code, stdout, stderr)."""
    from tasks.cli import main

    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_missing_dataset_path_is_exit_2_with_one_line(workspace, tmp_path, capsys):
    _, _, checkpoint = workspace
    code, out, err = _vip(capsys, "evaluate", "--task", "linprobe", "--checkpoint", str(checkpoint),
                          "--data", str(tmp_path / "none"), "--output", str(tmp_path / "out"))
    assert code == 2 and out == ""
    assert err.startswith("vip evaluate: error: dataset folder not found") and err.count("\n") == 1


def test_cli_malformed_annotation_file_is_exit_2_with_one_line(workspace, tmp_path, capsys):
    _, _, checkpoint = workspace
    make_coco_shapes(tmp_path / "coco", img_size=32, n=4)
    (tmp_path / "coco" / "annotations" / "instances_val2017.json").write_text('{"images": [], "annotations": 3}')
    code, out, err = _vip(capsys, "evaluate", "--task", "coco", "--checkpoint", str(checkpoint),
                          "--data", str(tmp_path / "coco"), "--output", str(tmp_path / "out"))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("vip evaluate: error: malformed COCO annotation file") and "instances_val2017.json" in err


def test_cli_evaluate_prints_one_json_object_with_both_encoders(workspace, evaluations, capsys):
    root, _, checkpoint = workspace
    code, out, _ = _vip(capsys, "evaluate", "--task", "ade20k", "--checkpoint", str(checkpoint),
                        "--data", str(root / "ade20k"), "--output", str(root / "out" / "ade20k"))
    assert code == 0
    printed = json.loads(out)
    assert printed == evaluations["ade20k"] and "miou" in printed["result"] and "miou" in printed["baseline"]


def test_cli_dp_finetune_setting_applies_to_finetune_only(workspace, capsys):
    root, _, checkpoint = workspace
    code, _, err = _vip(capsys, "evaluate", "--task", "linprobe", "--dp-finetune", "imagenet", "--checkpoint",
                        str(checkpoint), "--data", str(root / "digits"))
    assert code == 2 and "--dp-finetune applies to --task finetune" in err
