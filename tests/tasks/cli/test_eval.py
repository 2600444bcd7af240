"""``vip eval``: one JSON object with both encoders; a missing path or malformed file is one line and exit code 2."""

from __future__ import annotations

import json

from tasks.fixtures.eval_sets import make_coco_shapes


def test_cli_missing_dataset_path_is_exit_2_with_one_line(workspace, tmp_path, vip_here):
    _, _, checkpoint = workspace
    code, out, err = vip_here("eval", "--task", "linprobe", "--checkpoint", str(checkpoint),
                          "--data", str(tmp_path / "none"), "--output", str(tmp_path / "out"))
    assert code == 2 and out == ""
    assert err.startswith("vip eval: error: dataset folder not found") and err.count("\n") == 1


def test_cli_malformed_annotation_file_is_exit_2_with_one_line(workspace, tmp_path, vip_here):
    _, _, checkpoint = workspace
    make_coco_shapes(tmp_path / "coco", img_size=32, n=4)
    (tmp_path / "coco" / "annotations" / "instances_val2017.json").write_text('{"images": [], "annotations": 3}')
    code, out, err = vip_here("eval", "--task", "coco", "--checkpoint", str(checkpoint),
                          "--data", str(tmp_path / "coco"), "--output", str(tmp_path / "out"))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("vip eval: error: malformed COCO annotation file") and "instances_val2017.json" in err


def test_cli_evaluate_prints_one_json_object_with_both_encoders(workspace, evaluations, vip_here):
    root, _, checkpoint = workspace
    code, out, _ = vip_here("eval", "--task", "ade20k", "--checkpoint", str(checkpoint),
                        "--data", str(root / "ade20k"), "--output", str(root / "out" / "ade20k"))
    assert code == 0
    printed = json.loads(out)
    assert printed == evaluations["ade20k"] and "miou" in printed["result"] and "miou" in printed["baseline"]


def test_cli_dp_finetune_setting_applies_to_finetune_only(workspace, vip_here):
    root, _, checkpoint = workspace
    code, _, err = vip_here("eval", "--task", "linprobe", "--dp-finetune", "imagenet", "--checkpoint",
                        str(checkpoint), "--data", str(root / "digits"), "--output", str(root / "out" / "dp"))
    assert code == 2 and "--dp-finetune applies to --task finetune" in err


def test_cli_flags_set_where_the_job_runs_and_a_bad_device_is_one_line(workspace, vip_here):
    root, _, checkpoint = workspace
    code, out, _ = vip_here("eval", "--task", "fewshot", "--checkpoint", str(checkpoint), "--data",
                        str(root / "digits"), "--output", str(root / "cli-flags"), "--device", "cpu", "--no-baseline",
                        "--loader-workers", "1")
    printed = json.loads(out)
    assert code == 0 and printed["device"] == "cpu" and printed["baseline"] is None
    code, out, err = vip_here("eval", "--task", "fewshot", "--checkpoint", str(checkpoint), "--data",
                          str(root / "digits"), "--output", str(root / "cli-gpu"), "--device", "tpu")
    assert code == 2 and out == "" and err.startswith("vip eval: error: evaluation.device:") and err.count("\n") == 1
