"""The render stage: synthetic images from Shadertoy programs into webdataset shards.

``run_render`` splits the images into shards of ``samples_per_shard`` and renders the shards on
``workers`` processes, each with its own OpenGL context (one process: in this one). A worker writes a
shard's records to ``records/shard-NNNNNN.json`` and then its tar to ``shard-NNNNNN.tar`` (each written
whole), so a killed run leaves only complete shards, and a second run renders only the missing ones. The
folder is a stage folder (:mod:`tasks.runtime.folders`) claimed for the render's settings. At the end
``manifest.jsonl`` (one line per image: key, seed, program id, time, or the mixup components) and
``stats.json`` (images, skipped draws by reason) are rebuilt from the records.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vip_core.config import RenderConfig, VipConfig
from tasks.runtime.folders import StageFolder
from vip_core.atomic import write_json, write_text
from vip_core.data.shards import iter_samples, list_shards, sample_image, write_shard
from vip_core.synthetic.plan import (
    GeneratedPrograms,
    ProgramCache,
    ProgramPool,
    RenderOutcome,
    RenderPlan,
    mix_images,
    render_images,
)
from vip_core.synthetic.programs import load_program_folder
from vip_core.synthetic.renderer import ShaderRenderer
from vip_core.synthetic.sheet import contact_sheet

logger = logging.getLogger(__name__)

SHARD_PREFIX = "shard"
RECORDS = "records"
MANIFEST_FILE = "manifest.jsonl"
STATS_FILE = "stats.json"
JPEG_QUALITY = 95


@dataclass(frozen=True)
class RenderJob:
    """Everything a worker needs to render shards: plain values, so it pickles to spawned processes."""

    output: str
    size: int
    plan: RenderPlan
    samples_per_shard: int
    shaders: str | None

    def shard_indices(self, shard: int) -> range:
        start = shard * self.samples_per_shard
        return range(start, min(start + self.samples_per_shard, self.plan.num_images))

    @property
    def num_shards(self) -> int:
        return -(-self.plan.num_images // self.samples_per_shard)


def run_render(config: VipConfig, output: str | Path, shaders: str | Path | None = None) -> dict[str, Any]:
    """Renders ``config.data.render.num_images`` images into shards under ``output``; resumes a killed run.

    Args:
        config: the run's configuration (``data.render`` is used).
        output: the shard folder.
        shaders: a folder of Shadertoy programs (GLSL ``.frag`` / ``.glsl``, or Shadertoy JSON ``.json`` /
            Shaders21k ``.fragment``); None: the built-in generator.

    Returns:
        output, images, shards, rendered_shards (this call), resumed_shards (found complete), skipped
        (draws by reason), excluded_programs (folder files that cannot render in one pass), seconds,
        images_per_s (images rendered by this call per second).

    Raises:
        ValueError: ``output`` holds a render made with other settings, or no image could be rendered.
        FileNotFoundError: ``shaders`` is missing or holds no program file.
    """
    started = time.perf_counter()
    settings = config.data.render
    output = Path(output)
    pool, excluded = _program_pool(settings, shaders)
    job = RenderJob(
        output=str(output),
        size=settings.size,
        plan=RenderPlan(settings.seed, settings.num_images, settings.images_per_program, len(pool), settings.mixup),
        samples_per_shard=settings.samples_per_shard,
        shaders=None if shaders is None else str(Path(shaders).resolve()),
    )
    StageFolder(output, "render", _settings_record(job)).claim()
    (output / RECORDS).mkdir(exist_ok=True)
    done = _complete_shards(job)
    pending = [shard for shard in range(job.num_shards) if shard not in done]
    logger.info("render: %d shards to render, %d already complete", len(pending), len(done))
    _render_shards(job, pool, pending, settings.workers)
    summary = _write_manifest_and_stats(job, excluded)
    seconds = time.perf_counter() - started
    rendered_now = sum(len(job.shard_indices(shard)) for shard in pending)
    summary.update(
        rendered_shards=len(pending), resumed_shards=len(done), seconds=round(seconds, 3),
        images_per_s=round(rendered_now / seconds, 2) if pending else 0.0,
    )
    if summary["images"] == 0:
        raise ValueError(f"no image could be rendered: skipped {summary['skipped']}, excluded {excluded}")
    return summary


def _program_pool(settings: RenderConfig, shaders: str | Path | None) -> tuple[ProgramPool, dict[str, int]]:
    if shaders is None:
        return GeneratedPrograms(settings.num_programs), {}
    programs, excluded = load_program_folder(shaders)
    if not programs:
        raise ValueError(f"no program in {shaders} can be rendered in one pass (left out: {excluded})")
    return programs, excluded


def _settings_record(job: RenderJob) -> dict[str, Any]:
    plan = job.plan
    return {
        "size": job.size, "seed": plan.seed, "num_images": plan.num_images, "mixup": plan.mixup,
        "images_per_program": plan.images_per_program, "pool_size": plan.pool_size,
        "samples_per_shard": job.samples_per_shard, "shaders": job.shaders,
    }


def _shard_path(job: RenderJob, shard: int) -> Path:
    return Path(job.output) / f"{SHARD_PREFIX}-{shard:06d}.tar"


def _records_path(job: RenderJob, shard: int) -> Path:
    return Path(job.output) / RECORDS / f"{SHARD_PREFIX}-{shard:06d}.json"


def _complete_shards(job: RenderJob) -> set[int]:
    return {
        shard for shard in range(job.num_shards)
        if _shard_path(job, shard).exists() and _records_path(job, shard).exists()
    }


# ------------------------------------------------------------------------------------------------ workers

_WORKER: dict[str, Any] = {}


def _init_worker(job: RenderJob, pool: ProgramPool | None = None) -> None:
    """Per process: one GL context, its program cache, and the program pool (loaded again if not given)."""
    if pool is None:
        pool = GeneratedPrograms(job.plan.pool_size) if job.shaders is None else load_program_folder(job.shaders)[0]
    renderer = ShaderRenderer(job.size)
    _WORKER.update(job=job, pool=pool, renderer=renderer, cache=ProgramCache(renderer))
    logger.info("render worker %d on %s", os.getpid(), renderer.device)


def _close_worker() -> None:
    if _WORKER:
        _WORKER["cache"].release()
        _WORKER["renderer"].release()
        _WORKER.clear()


def _render_shard_in_worker(shard: int) -> tuple[int, int]:
    return shard, render_shard(_WORKER["job"], _WORKER["cache"], _WORKER["pool"], shard)


def _render_shards(job: RenderJob, pool: ProgramPool, pending: list[int], workers: int) -> None:
    if not pending:
        return
    if workers == 1 or len(pending) == 1:
        _init_worker(job, pool)
        try:
            for done, shard in enumerate(pending, start=1):
                _log_shard(shard, render_shard(job, _WORKER["cache"], _WORKER["pool"], shard), done, len(pending))
        finally:
            _close_worker()
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        min(workers, len(pending)), mp_context=context, initializer=_init_worker, initargs=(job,)
    ) as processes:
        futures = {processes.submit(_render_shard_in_worker, shard): shard for shard in pending}
        try:
            for done, future in enumerate(as_completed(futures), start=1):
                _log_shard(*future.result(), done, len(pending))
        except BrokenProcessPool:  # a worker died (a driver crash): the complete shards stay, a rerun resumes
            unfinished = sorted(shard for future, shard in futures.items() if not future.done() or future.exception())
            raise RuntimeError(
                f"a render worker died; shards {unfinished[:5]}{'...' if len(unfinished) > 5 else ''} are not "
                "complete: run again to resume"
            ) from None


def _log_shard(shard: int, count: int, done: int, total: int) -> None:
    logger.info("render: shard %06d complete, %d images (%d of %d shards)", shard, count, done, total)


def render_shard(job: RenderJob, cache: ProgramCache, pool: ProgramPool, shard: int) -> int:
    """Renders, encodes and writes shard ``shard`` (records first, then the tar); returns its image count."""
    indices = list(job.shard_indices(shard))
    outcome = render_images(cache, job.plan, pool, indices)
    samples = _shard_samples(job, outcome)
    order = np.random.default_rng([job.plan.seed, shard]).permutation(len(samples))  # neighbours: other programs
    samples = [samples[i] for i in order]
    records = {"records": [record for _, record in samples], "skipped": dict(outcome.skipped)}
    write_json(_records_path(job, shard), records, indent=None)
    write_shard(_shard_path(job, shard), [(record["key"], {"jpg": jpeg, "json": record}) for jpeg, record in samples])
    return len(samples)


def _shard_samples(job: RenderJob, outcome: RenderOutcome) -> list[tuple[bytes, dict[str, Any]]]:
    """(jpeg bytes, record) per rendered image, in index order; mixed when ``mixup`` > 1."""
    seed = job.plan.seed
    if job.plan.mixup > 1:
        mixed = mix_images(job.plan, outcome.images)
        return [
            (_encode(image), {"key": _key(index), "seed": seed, "components": components})
            for index, (image, components) in mixed.items()
        ]
    return [
        (_encode(item.image), {"key": _key(index), "seed": seed, "program": item.program_id, "time": item.time})
        for index, item in sorted(outcome.images.items())
    ]


def _key(index: int) -> str:
    return f"{index:09d}"


def _encode(image: np.ndarray) -> bytes:
    """JPEG at quality 95 without chroma subsampling: 4:2:0 blurs the colour of small, detailed images."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=JPEG_QUALITY, subsampling=0)
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------ manifest, stats


def _write_manifest_and_stats(job: RenderJob, excluded: dict[str, int]) -> dict[str, Any]:
    skipped: Counter = Counter()
    images = 0
    lines = []
    for shard in range(job.num_shards):
        shard_records = json.loads(_records_path(job, shard).read_text())
        skipped.update(shard_records["skipped"])
        images += len(shard_records["records"])
        lines.extend(json.dumps(record, sort_keys=True) for record in shard_records["records"])
    output = Path(job.output)
    write_text(output / MANIFEST_FILE, "".join(f"{line}\n" for line in lines))
    stats = {
        "output": str(output), "images": images, "shards": job.num_shards, "size": job.size,
        "programs": job.shaders or "generator", "skipped": dict(sorted(skipped.items())),
        "excluded_programs": dict(sorted(excluded.items())),
    }
    write_json(output / STATS_FILE, stats)
    return stats


def write_contact_sheet(shards: str | Path, path: str | Path, count: int = 64, columns: int = 8) -> dict[str, Any]:
    """Tiles the first ``count`` images of the shards in ``shards`` into the PNG ``path``."""
    images = []
    for sample in iter_samples(list_shards(shards, SHARD_PREFIX)):
        images.append(np.asarray(sample_image(sample)))
        if len(images) == count:
            break
    if not images:
        raise ValueError(f"no image in the shards of {shards}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(contact_sheet(images, columns=columns)).save(path)
    return {"contact_sheet": str(path), "images": len(images)}
