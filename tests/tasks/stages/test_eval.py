"""run_evaluation: every job end to end on the tiny preset with a saved checkpoint, metrics.json with
the result and the random-init baseline, the stored result reused, and the MLflow child run."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flows.graph import EVAL_THREADS
from tasks.stages.eval import METRICS_FILE, run_evaluation
from tests.tasks.conftest import EVAL_DATA


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
    with pytest.raises(ValueError, match="choose another output folder"):
        run_evaluation(config, "fewshot", str(checkpoint), str(root / "digits"), str(output))


def test_child_run_under_the_parent_holds_result_and_baseline_metrics(workspace, evaluations):
    from tasks.runtime import tracking

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


def test_the_child_run_spans_the_job_it_records(workspace):
    from tasks.runtime import tracking

    root, config, checkpoint = workspace
    parent = tracking.start_run("pipeline-under-test")
    metrics = run_evaluation(config, "fewshot", str(checkpoint), str(root / "digits"), str(root / "timed" / "fewshot"),
                             mlflow_run_id=parent)
    (child,) = tracking.child_runs(parent)
    assert child.info.run_name == "eval-fewshot" and child.info.status == "FINISHED"
    assert child.data.tags["vip.checkpoint"] == str(checkpoint)
    job_ms = 1000 * sum(metrics["seconds"].values())
    assert child.info.end_time - child.info.start_time >= job_ms > 0


def test_no_job_draws_from_torchs_global_generator_outside_a_seeded_block(workspace):
    """A draw outside :func:`seeded` changes the global generator's state; beside a job inside a seeded block
    it shifts that job's draws (the few-shot job's ``nn.Linear`` did so: the linear probe's numbers then
    depended on the timing of the jobs beside it)."""
    root, config, checkpoint = workspace
    torch.manual_seed(1234)
    for task, data in EVAL_DATA.items():
        before = torch.get_rng_state()
        run_evaluation(config, task, str(checkpoint), str(root / data), str(root / "rng" / task))
        assert torch.equal(torch.get_rng_state(), before), f"the {task} job drew from torch's global generator"


def test_the_same_config_gives_the_same_numbers_in_parallel_threads_as_one_at_a_time(workspace, evaluations):
    root, config, checkpoint = workspace
    with ThreadPoolExecutor(EVAL_THREADS) as pool:  # as the flows run the jobs
        futures = {task: pool.submit(run_evaluation, config, task, str(checkpoint), metrics["data"],
                                     str(root / "parallel" / task))
                   for task, metrics in evaluations.items()}
    for task, future in futures.items():
        again = future.result()
        assert (again["result"], again["baseline"]) == (evaluations[task]["result"], evaluations[task]["baseline"]), task


def test_without_the_baseline_a_job_runs_once_and_leaves_no_work_behind(workspace):
    from vip_core.config import with_overrides

    root, config, checkpoint = workspace
    output = root / "no-baseline" / "linprobe"
    alone = with_overrides(config, {"evaluation.random_init_baseline": False})
    metrics = run_evaluation(alone, "linprobe", str(checkpoint), str(root / "digits"), str(output))
    assert metrics["baseline"] is None and metrics["baseline_encoder"] is None and set(metrics["seconds"]) == {"result"}
    assert metrics["result"]["top1"] >= 2 * metrics["result"]["chance_top1"]
    assert sorted(path.name for path in output.iterdir()) == [METRICS_FILE, "stage.json"]  # features removed
