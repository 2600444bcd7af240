"""Which part of the config each stage depends on: the stage's output folder and its Prefect cache key.

A stage's cache key is a hash of the stage's name, its slice of the config (``data.render`` for render;
``model``, ``private`` and ``privacy`` for the private pre-training), its other parameters, and a
fingerprint of its input paths (the path and the size and modification time of the files at the top of
a folder: shards, ``checkpoint.pt``, the class folders of an ImageFolder). Running a flow again with the
same config and unchanged inputs finds every finished stage in Prefect's result store and skips it; a
changed slice or a rewritten input runs the stage again.

The output folder of a stage is named after the same slice (``ingest-1a2b3c4d``, with the url list's
path for ingestion), so a run with other settings never writes into the folder of a finished one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from vip_core.config import VipConfig

CACHE_VERSION = 1

# The config fields each stage reads; a field outside its slice does not invalidate the stage.
CONFIG_SLICES: dict[str, tuple[str, ...]] = {
    "ingest": ("data.ingest",),
    "render": ("data.render",),
    "pretrain-syn": ("model", "synthetic", "data.loader_workers"),
    "pretrain-dp": ("model", "private", "privacy", "data.loader_workers"),
    "evaluate": ("model", "evaluation"),
    "audit": ("model", "private", "privacy"),
}
# Fields left out of a slice: the list of evaluation tasks does not change what one task computes.
EXCLUDED_FIELDS = {"evaluation": {"tasks"}}
# Parameters that name inputs: their files are fingerprinted. Outputs are keyed by path only.
INPUT_PARAMETERS = ("url_list", "eval_images", "shaders", "data", "init_checkpoint", "checkpoint")
IGNORED_PARAMETERS = ("config", "parent_run_id")


def config_slice(config: VipConfig, stage: str) -> dict[str, Any]:
    """The JSON of the fields ``stage`` depends on, keyed by dotted path."""
    return {path: _dump(_field(config, path), path) for path in CONFIG_SLICES[stage]}


def slice_digest(config: VipConfig, stage: str, inputs: tuple[str, ...] = (), length: int = 8) -> str:
    """A short hash of the stage's config slice and its input paths: the suffix of its output folder."""
    return digest([config_slice(config, stage), [str(Path(path).resolve()) for path in inputs if path]])[:length]


def stage_folder(workdir: str | Path, stage: str, config: VipConfig, inputs: tuple[str, ...] = ()) -> str:
    """``workdir/<stage>-<digest>``: where a stage writes for this config and these input paths."""
    return str(Path(workdir) / f"{stage}-{slice_digest(config, stage, inputs)}")


def fingerprint(path: str | Path | None) -> Any:
    """The path with the size and mtime of the file, or of each file at the top of the folder."""
    if path is None:
        return None
    path = Path(path).resolve()
    if path.is_file():
        return [str(path), _stat(path)]
    if path.is_dir():
        return [str(path), sorted((child.name, _stat(child)) for child in path.iterdir())]
    return [str(path), "missing"]


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


def _dump(value: Any, path: str) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude=EXCLUDED_FIELDS.get(path))
    return value


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _stat(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def digest(payload: Any) -> str:
    """The sha256 of the payload's canonical JSON."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
