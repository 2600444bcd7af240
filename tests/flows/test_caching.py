"""Stage cache keys and output folders: same config and inputs, same key; a relevant change, a new one."""

from __future__ import annotations

import os
from types import SimpleNamespace

from flows.caching import eval_folder, eval_stage, stage_cache_key, stage_folder
from vip_core.config import (
    EVAL_SPEED_FIELDS, EVAL_TASK_FIELDS, EVAL_TASKS, EvalPair, EvaluationConfig, tiny, with_overrides,
)

CONTEXT = SimpleNamespace()


def _render_key(config, output="/runs/render"):
    return stage_cache_key("render")(CONTEXT, {"config": config, "output": output, "parent_run_id": "a"})


def test_render_key_ignores_the_mlflow_parent_and_fields_outside_its_slice():
    config = tiny()
    same = _render_key(config)
    assert same == stage_cache_key("render")(CONTEXT, {"config": config, "output": "/runs/render", "parent_run_id": "b"})
    assert same == _render_key(with_overrides(config, {"private.steps": 99, "evaluation.linprobe_epochs": 1}))


def test_render_key_changes_with_its_slice_and_its_output():
    config = tiny()
    assert _render_key(config) != _render_key(with_overrides(config, {"data.render.num_images": 128}))
    assert _render_key(config) != _render_key(config, output="/elsewhere")


def test_private_pretraining_key_follows_privacy_but_the_synthetic_one_does_not():
    key = stage_cache_key(lambda parameters: {"synthetic": "pretrain-syn", "private": "pretrain-dp"}[parameters["stage"]])
    config, stricter = tiny(), with_overrides(tiny(), {"privacy.target_epsilon": 2.0})

    def both(cfg, stage):
        return key(CONTEXT, {"config": cfg, "stage": stage, "data": None, "output": "/o", "init_checkpoint": None})

    assert both(config, "private") != both(stricter, "private")
    assert both(config, "synthetic") == both(stricter, "synthetic")


def _eval_key(config, task, checkpoint=None):
    parameters = {"config": config, "task": task, "checkpoint": checkpoint, "data": None, "output": f"/o/{task}"}
    return stage_cache_key(eval_stage)(CONTEXT, parameters)


def test_evaluation_key_does_not_depend_on_the_list_of_other_tasks():
    fewer = with_overrides(tiny(), {"evaluation.tasks": ["linprobe"]})
    assert _eval_key(tiny(), "linprobe") == _eval_key(fewer, "linprobe")


def test_a_changed_evaluation_field_reruns_only_the_jobs_that_read_it(tmp_path):
    config = tiny()
    changes = [("evaluation.linprobe_epochs", 7, {"linprobe"}), ("evaluation.detection_lr", 0.5, {"coco"}),
               ("evaluation.linprobe_last_blocks", 1, {"linprobe", "fewshot"}),
               ("evaluation.layer_decay", 0.5, {"finetune", "coco", "ade20k"}),
               ("evaluation.batch_size", 3, set(EVAL_TASKS))]
    for field, value, readers in changes:
        changed = with_overrides(config, {field: value})
        rerun = {task for task in EVAL_TASKS if _eval_key(changed, task) != _eval_key(config, task)}
        moved = {task for task in EVAL_TASKS
                 if eval_folder(changed, tmp_path, pair(task), "c", "d") != eval_folder(config, tmp_path, pair(task), "c", "d")}
        assert rerun == moved == readers, field


def pair(task: str, data: str = "classification") -> EvalPair:
    return EvalPair(task=task, data=data)


def test_every_evaluation_setting_is_in_the_key_of_a_job_but_what_changes_only_the_speed():
    read = {name for fields in EVAL_TASK_FIELDS.values() for name in fields}
    assert read == set(EvaluationConfig.model_fields) - {"tasks", "suite", *EVAL_SPEED_FIELDS}
    config = tiny()
    faster = with_overrides(config, {"evaluation.loader_workers": 4, "evaluation.cpus_per_worker": 0.5})
    assert all(_eval_key(faster, task) == _eval_key(config, task) for task in EVAL_TASKS)


def test_two_pairs_of_one_task_have_folders_of_their_own(tmp_path):
    config = tiny()
    imagenet, places = (eval_folder(config, tmp_path, pair("linprobe", data), "c", "d") for data in ("imagenet", "places365"))
    assert imagenet != places and imagenet.startswith(str(tmp_path / "eval-linprobe-imagenet-"))
    assert eval_folder(config, tmp_path, pair("linprobe"), "c", "d").startswith(str(tmp_path / "eval-linprobe-"))


def test_a_rewritten_input_file_changes_the_key(tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"weights one")
    key = stage_cache_key(eval_stage)
    parameters = {"config": tiny(), "task": "linprobe", "checkpoint": str(tmp_path), "data": None, "output": "/o"}
    before = key(CONTEXT, parameters)
    assert key(CONTEXT, parameters) == before
    checkpoint.write_bytes(b"weights two, retrained")
    os.utime(checkpoint, ns=(1, 1))
    assert key(CONTEXT, parameters) != before


def test_output_folders_are_named_after_the_slice_and_the_inputs(tmp_path):
    config = tiny()
    render = stage_folder(tmp_path, "render", config)
    assert render.startswith(str(tmp_path / "render-"))
    assert render == stage_folder(tmp_path, "render", with_overrides(config, {"private.steps": 3}))
    assert render != stage_folder(tmp_path, "render", with_overrides(config, {"data.render.seed": 1}))
    assert stage_folder(tmp_path, "ingest", config, inputs=("a.parquet",)) != stage_folder(
        tmp_path, "ingest", config, inputs=("b.parquet",))
