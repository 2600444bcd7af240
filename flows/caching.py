"""Which part of the config each stage depends on: the stage's output folder and its Prefect cache key.

A stage's cache key is a hash of the stage's name, its slice of the config (``data.render`` for render;
``model``, ``private`` and ``privacy`` for the private pre-training; for an evaluation job, the model and
the ``evaluation`` fields that job reads), its other parameters, and a
fingerprint of its input paths (the path and the size and modification time of the files at the top of
a folder: shards, ``checkpoint.pt``, the class folders of an ImageFolder; for an fsspec URL such as
``s3://bucket/eval``, the listing of every file below it). Running a flow again with the
same config and unchanged inputs finds every finished stage in Prefect's result store and skips it; a
changed slice or a rewritten input runs the stage again.

The output folder of a stage is named after the same slice and its input paths, a URL with its listing and an
image folder with every file below it (``ingest-1a2b3c4d``), so a run with other settings or data never writes into the folder of a finished one.
:func:`stage_folders` names every stage's folder for one config and one set of inputs: the pipeline and each
stage's own flow use it, so they share their folders and their cache keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from tasks.runtime.environment import state_paths
from tasks.runtime.folders import digest, fingerprint, identity
from vip_core.config import EVAL_TASK_FIELDS, EvalPair, VipConfig

CACHE_VERSION = 2

# The config fields each stage reads; a field outside its slice does not invalidate the stage.
CONFIG_SLICES: dict[str, tuple[str, ...]] = {
    "ingest": ("data.ingest",),
    "render": ("data.render",),
    "pretrain-syn": ("model", "synthetic"),
    "pretrain-dp": ("model", "private", "privacy"),
    "audit": ("model", "private", "privacy"),
    # each evaluation job: the evaluation fields it reads, so a change to one job's settings re-runs it alone
    **{f"eval-{task}": ("model", *(f"evaluation.{name}" for name in fields))
       for task, fields in EVAL_TASK_FIELDS.items()},
}
# Parameters that name inputs: their files are fingerprinted. Outputs are keyed by path only.
INPUT_PARAMETERS = ("url_list", "eval_images", "shaders", "data", "init_checkpoint", "checkpoint")
IGNORED_PARAMETERS = ("config", "parent_run_id")


def config_slice(config: VipConfig, stage: str) -> dict[str, Any]:
    """The JSON of the fields ``stage`` depends on, keyed by dotted path."""
    return {path: _dump(_field(config, path)) for path in CONFIG_SLICES[stage]}


def slice_digest(config: VipConfig, stage: str, inputs: tuple[str, ...] = (), length: int = 8,
                 contents: tuple[Any, ...] = ()) -> str:
    """A short hash of the stage's config slice, its input paths (a URL with its listing, :func:`identity`) and
    ``contents`` (what else names the inputs: the files of an image folder): the suffix of its output folder.

    Raises:
        FileNotFoundError: an input URL with no file below it.
    """
    named = [config_slice(config, stage), [identity(path) for path in inputs if path]]
    return digest(named + [list(contents)] if contents else named)[:length]


def stage_folder(workdir: str | Path, stage: str, config: VipConfig, inputs: tuple[str, ...] = (),
                 contents: tuple[Any, ...] = ()) -> str:
    """``workdir/<stage>-<digest>``: where a stage writes for this config, these input paths and ``contents``."""
    return str(Path(workdir) / f"{stage}-{slice_digest(config, stage, inputs, contents=contents)}")


def default_workdir(config: VipConfig) -> str:
    """``$VIP_HOME/runs/<config name>``: where the stages' folders are unless a flow is given another."""
    return str(state_paths()["runs"] / config.name)


def stage_folders(config: VipConfig, workdir: str | Path, url_list: str, eval_data: str,
                  image_folder: str = "") -> dict[str, str]:
    """Where each training-side stage writes, for one config and the pipeline's inputs: the private data (a url
    list, or an image folder named with every file below it, so that a folder with a photo added, removed or
    rewritten is ingested into a new folder) and the evaluation data.

    The evaluation's folder also depends on the checkpoint evaluated (:func:`eval_folder`), the audit's on
    its own settings (:func:`audit_folder`).
    """
    if image_folder:
        from tasks.stages.ingest import image_files

        ingest = stage_folder(workdir, "ingest", config, inputs=(image_folder, eval_data),
                              contents=(image_files(image_folder),))
    else:
        ingest = stage_folder(workdir, "ingest", config, inputs=(url_list, eval_data))
    folders = {"ingest": ingest, "render": stage_folder(workdir, "render", config)}
    folders["pretrain-syn"] = stage_folder(workdir, "pretrain-syn", config, inputs=(folders["render"],))
    folders["pretrain-dp"] = stage_folder(
        workdir, "pretrain-dp", config, inputs=(folders["ingest"], folders["pretrain-syn"]))
    return folders


def eval_folder(config: VipConfig, workdir: str | Path, pair: EvalPair, checkpoint: str, eval_data: str) -> str:
    """``workdir/eval-<pair>-<digest>``: the folder of one pair of the evaluation suite, named after the settings
    its task reads, the checkpoint and the evaluation data (``eval-linprobe-imagenet-1a2b3c4d``)."""
    digest_ = slice_digest(config, f"eval-{pair.task}", (checkpoint, eval_data))
    return str(Path(workdir) / f"eval-{pair.name}-{digest_}")


def audit_folder(config: VipConfig, workdir: str | Path, canaries: int) -> str:
    """The audit's folder for this config (its δ included) and number of canaries."""
    return f"{stage_folder(workdir, 'audit', config)}-m{canaries}"


def eval_stage(parameters: dict[str, Any]) -> str:
    """``eval-<task>``: the stage of the evaluation task run with these parameters."""
    return f"eval-{parameters['task']}"


def stage_cache_key(stage: str | Callable[[dict[str, Any]], str]) -> Callable[[Any, dict[str, Any]], str]:
    """A Prefect ``cache_key_fn`` for a stage task.

    Args:
        stage: the stage's name in :data:`CONFIG_SLICES`, or a function of the task's parameters that
            returns it (the pre-training task serves two stages).
    """

    def cache_key(context: Any, parameters: dict[str, Any]) -> str:
        name = stage(parameters) if callable(stage) else stage
        payload = {
            "version": CACHE_VERSION,
            "stage": name,
            "config": config_slice(parameters["config"], name),
            "parameters": {
                key: fingerprint(value) if key in INPUT_PARAMETERS else _jsonable(value)
                for key, value in sorted(parameters.items())
                if key not in IGNORED_PARAMETERS
            },
        }
        return f"vip-{name}-{digest(payload)}"

    return cache_key


def _field(config: VipConfig, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _dump(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
