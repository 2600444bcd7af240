"""Ingestion: a LAION-format url list (:func:`run_ingest`) or a folder or bucket of image files
(:func:`run_ingest_images`) to clean webdataset shards.

For a url list, img2dataset downloads the rows into raw shards (bodies kept as sent, no re-encoding) in a child
process; meanwhile each raw shard is *judged* as soon as img2dataset finishes it: decoded, filtered, hashed and
decontaminated against the evaluation images (:mod:`tasks.stages.ingest_shards`). Files are judged the same way,
each shard's task reading its files itself. Once every shard is judged,
one global deduplication decides every candidate (:func:`vip_core.data.global_dedup.deduplicate`: first in
row order wins, whatever the number of machines), and each judged shard becomes ``web-{shard:06d}.tar``
named after its raw shard. Layout of the output folder::

    web-000000.tar ...      clean shards (key.jpg + key.json), readable by vip_core.data.shards
    manifest.parquet        one row per input row (url or file): status (kept, failed, filtered, duplicate,
                            decontaminated), reason, hashes, the clean shard that holds it
    stats.json              {"input", "downloaded", "failed", "filtered", "duplicates", "decontaminated", "kept"}
    stage.json              the stage folder's claim: url list or files, settings, evaluation images
                            (tasks.runtime.folders)
    _ingest/                state: the input rows as the shards' tasks read them, the url list as img2dataset reads it,
                            raw shards, judged shards, manifest parts, img2dataset's log

Where the work runs is ``data.ingest.distributor``: ``multiprocessing`` (img2dataset's process pool, the
judging and the deduplication in this process) or ``ray`` (img2dataset's Ray distributor and Ray tasks, on
the cluster of ``RAY_ADDRESS`` or a local Ray; the output folder must then be one every node reads and
writes at the same path). Both give the same shards, manifest and stats.

Resuming: img2dataset's incremental mode skips raw shards it finished (their ``*_stats.json``); a shard is
judged again unless its judged part exists, and finished again unless its manifest part exists; each file is
written whole, the marking one last. The deduplication runs again whenever a shard is left to finish (it is
deterministic: the same decisions every time).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.runtime.environment import configure_environment, state_paths
from tasks.runtime.folders import StageFolder, digest, eval_data_copy, identity
from tasks.runtime.runner import Runner, task_runner
from tasks.stages.ingest_shards import (
    MANIFEST_SCHEMA, SHARD_PREFIX, Contamination, IngestLayout, JudgedShard, ShardWork, fault_shard,
    finalize_shards, judge_shard, load_candidates, write_parquet,
)
from vip_core.atomic import atomic_path, write_json
from vip_core.config import IngestConfig, VipConfig
from vip_core.data import storage
from vip_core.data.dedup import build_contamination_index
from vip_core.data.filters import SampleFilter
from vip_core.data.global_dedup import deduplicate
from vip_core.data.shards import list_shards
from vip_core.data.urllist import UrlList, file_digest, read_url_list

logger = logging.getLogger(__name__)

# Settings that change speed only: a resumed run may change them.
_SPEED_SETTINGS = {"processes", "threads", "timeout_s", "distributor", "rows_per_partition"}
_POLL_S = 0.1
_STOP_GRACE_S = 20.0
CPUS_PER_TASK = 1.0  # a shard's judging and finishing, and each deduplication step, are CPU-bound
KEY_DIGITS = 9  # an image file's key is its row number, zero-padded to at least this many digits


class IngestError(RuntimeError):
    """The download stage stopped before finishing; running the same command again resumes it."""


# ------------------------------------------------------------------------------------------------ task


def run_ingest(
    config: VipConfig, url_list: str | Path, output: str | Path, eval_images: str | Path | None = None
) -> dict[str, Any]:
    """Downloads, filters, deduplicates and decontaminates a url list into clean shards in ``output``.

    Args:
        config: the run's configuration; ``config.data.ingest`` drives this stage.
        url_list: a LAION-format parquet, csv or jsonl file.
        output: the folder for the clean shards, ``manifest.parquet`` and ``stats.json``: a local path, or an
            fsspec URL (``s3://bucket/web``) with the work in a local staging folder (``$VIP_HOME/data/staging/…``,
            which keeps it for a re-run): each clean shard is uploaded as soon as it is finished, the manifest and
            ``stats.json`` last (the folder is complete once ``stats.json`` is there).
        eval_images: a folder of downstream evaluation images, local or an fsspec URL (copied once into
            ``$VIP_HOME/data/eval/``); near duplicates of them are removed.

    Returns:
        The contents of ``stats.json`` plus ``output`` (the folder) and ``shards`` (clean shard count).

    Raises:
        FileNotFoundError, ValueError: a missing or malformed url list or evaluation folder, or an
            output folder that holds an ingestion of another url list or other settings.
        IngestError: img2dataset stopped early; running again resumes.
    """
    configure_environment()
    urls = read_url_list(url_list)
    urls.check_conditions(_sample_filter(config.data.ingest).conditions)
    source = IngestInput(urls.table, urls.url_column, urls.caption_column,
                         {"url_list_sha256": file_digest(urls.path)}, url_list=urls)
    return ingest_input(config, source, output, eval_images)


def run_ingest_images(
    config: VipConfig, images: str | Path, output: str | Path, eval_images: str | Path | None = None
) -> dict[str, Any]:
    """Filters, deduplicates and decontaminates the files below ``images`` into clean shards in ``output``, as
    :func:`run_ingest` does a url list's downloads: the same judging, shards, manifest, ``stats.json`` and resume.

    Args:
        config: the run's configuration; ``config.data.ingest`` drives this stage (its url-list settings aside).
        images: a folder, searched at every depth, or an fsspec URL (``s3://bucket/photos``). Every file below it
            is one input row, in the order of its path (the first of two duplicates is kept); names starting with
            ``.`` (``.DS_Store``, ``.git/``) are left out. A file that is not a usable image is counted as failed
            with its reason (``unreadable``, ``not_an_image``, ``corrupt``, ``truncated``, ``empty_body``,
            ``decompression_bomb``).
        output: as for :func:`run_ingest`.
        eval_images: as for :func:`run_ingest`.

    Raises:
        FileNotFoundError, ValueError: no file below ``images``, ``data.ingest.conditions`` set (they test url-list
            columns), a missing evaluation folder, or an output folder that holds an ingestion of other files or
            other settings.
    """
    configure_environment()
    if config.data.ingest.conditions:
        raise ValueError("data.ingest.conditions: conditions test url-list columns, which image files do not have")
    files = image_files(images)
    if not files:
        raise ValueError(f"no image files below {images}")
    digits = max(KEY_DIGITS, len(str(len(files) - 1)))
    table = pa.table({"path": list(files), "key": [f"{row:0{digits}d}" for row in range(len(files))]})
    source = IngestInput(table, "path", None, {"image_files_sha256": digest(files)}, images=str(images))
    return ingest_input(config, source, output, eval_images)


def image_files(images: str | Path) -> dict[str, list]:
    """The files below ``images`` that :func:`run_ingest_images` reads, by relative path, with their size and version.

    Raises:
        FileNotFoundError: ``images`` does not exist.
    """
    return {name: version for name, version in storage.tree(images).items()
            if not any(part.startswith(".") for part in name.split("/"))}


@dataclass(frozen=True)
class IngestInput:
    """What an ingestion reads, one row per image in the order that decides which of two duplicates is kept.

    Attributes:
        table: the rows; the filters' conditions name its columns.
        url_column: the column naming each row's image (for files: ``path``, relative to ``images``).
        caption_column: the column of captions, if any.
        claim: what identifies the input in the output folder's ``stage.json``.
        url_list: the url list img2dataset downloads; None for files.
        images: the folder or fsspec URL the files are read from; None for a url list.
    """

    table: pa.Table
    url_column: str
    caption_column: str | None
    claim: dict[str, Any]
    url_list: UrlList | None = None
    images: str | None = None


def ingest_input(config: VipConfig, source: IngestInput, output: str | Path,
                 eval_images: str | Path | None = None) -> dict[str, Any]:
    """The stage on ``source`` (a url list or files), into ``output`` as :func:`run_ingest` describes."""
    if not storage.is_url(output):
        return _ingest(config, source, Path(output), eval_images, upload_to=None)
    staged = _ingest(config, source, staging_folder(str(output)), eval_images, upload_to=str(output))
    storage.put([Path(staged["output"]) / name for name in ("manifest.parquet", "stats.json")], str(output))
    return {**staged, "output": str(output), "staging": staged["output"]}


def _ingest(config: VipConfig, source: IngestInput, output: Path, eval_images: str | Path | None,
            upload_to: str | None) -> dict[str, Any]:
    """The stage in the local folder ``output``, each clean shard also uploaded to the URL ``upload_to`` when given
    (by the task that finishes it)."""
    settings = config.data.ingest
    rows = source.table.num_rows
    contamination, eval_hashes = _contamination(eval_images, settings.decontaminate_max_distance)
    layout = IngestLayout(output.resolve())
    with exclusive_use(layout) as lock:
        StageFolder(layout.output, "ingest", _fingerprint(settings, source, eval_hashes)).claim()
        shard_count = math.ceil(rows / settings.samples_per_shard)
        if not all(layout.part(shard).exists() for shard in range(shard_count)):
            work = ShardWork(layout, settings, _sample_filter(settings), contamination, source.url_column,
                             source.caption_column, upload_to, fault_shard(), images=source.images)
            _write_inputs(layout, source, settings.samples_per_shard)
            with task_runner(settings.distributor, CPUS_PER_TASK) as runner:
                judged = _fetch_and_judge(runner, work, shard_count, lock)
                _deduplicate_and_finalize(runner, work, judged)
        stats = _finish(layout, shard_count, rows, settings.samples_per_shard)
    return {**stats, "output": str(layout.output), "shards": len(list_shards(layout.output, SHARD_PREFIX))}


def _contamination(eval_images: str | Path | None, max_distance: int) -> tuple[Contamination | None, dict[str, int]]:
    """The index of the evaluation images and their hashes (a URL's images copied once, as the evaluation
    jobs' data are); none without evaluation images."""
    if not eval_images:
        return None, {}
    with eval_data_copy(str(eval_images), identity(eval_images)) as local:
        index, hashes = build_contamination_index(local, max_distance)
    return Contamination(index, tuple(hashes)), hashes


def staging_folder(url: str) -> Path:
    """The local folder where ingestion into the URL ``url`` does its work (one per URL)."""
    return state_paths()["data"] / "staging" / hashlib.sha256(url.encode()).hexdigest()[:16]


@contextlib.contextmanager
def exclusive_use(layout: IngestLayout) -> Iterator[int]:
    """Holds an exclusive lock on the output folder; yields the lock's file descriptor.

    The img2dataset child inherits the descriptor, so the folder stays locked until the download stops,
    even if this process is killed alone.

    Raises:
        ValueError: another ingestion holds the folder.
    """
    layout.work.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(layout.work / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise ValueError(f"output {layout.output} is being written by another ingestion") from None
    try:
        yield descriptor
    finally:
        os.close(descriptor)


def _fetch_and_judge(runner: Runner, work: ShardWork, shard_count: int, lock: int) -> list[JudgedShard]:
    """Every shard judged: a url list's as img2dataset downloads them, files' as they are read by the tasks."""
    if work.images is None:
        return _download_and_judge(runner, work, shard_count, lock)
    shared = runner.share(work)
    return runner.get([runner.submit(judge_shard, shared, shard_id) for shard_id in range(shard_count)])


def _download_and_judge(runner: Runner, work: ShardWork, shard_count: int, lock: int) -> list[JudgedShard]:
    """Runs img2dataset on the shards not yet downloaded, judging each shard (in order) as soon as it is."""
    layout, settings = work.layout, work.settings
    pending = [shard for shard in range(shard_count) if not layout.judged_part(shard).exists()]
    downloader = None if all(layout.raw_done(shard).exists() for shard in pending) else start_img2dataset(
        img2dataset_arguments(settings, layout.url_input, layout.raw, reencode=False), layout.log, keep_fds=(lock,),
        env=runner.environment(),
    )
    shared = runner.share(work)
    try:
        handles = []
        for shard_id in range(shard_count):
            if shard_id in pending:
                _wait_for_raw_shard(layout, shard_id, downloader)
            handles.append(runner.submit(judge_shard, shared, shard_id))
        judged = runner.get(handles)
    except BaseException:
        stop_process(downloader)
        raise
    finish_process(downloader)
    return judged


def _deduplicate_and_finalize(runner: Runner, work: ShardWork, judged: list[JudgedShard]) -> None:
    """The global deduplication of every judged shard's candidates, then each unfinished shard finished with the
    decisions of its candidates (shards grouped into blocks of about ``rows_per_partition`` candidates)."""
    settings = work.settings
    blocks = _blocks(judged, settings.rows_per_partition)
    chunks = [runner.submit(load_candidates, work.layout, [shard.shard_id for shard in block]) for block in blocks]
    decisions = deduplicate(runner, chunks, candidates=sum(shard.candidates for shard in judged),
                            max_distance=settings.phash_max_distance, rows_per_partition=settings.rows_per_partition,
                            bounds=[block[0].first_id for block in blocks[1:]])
    shared = runner.share(work)
    runner.get([runner.submit(finalize_shards, shared, [shard.shard_id for shard in block], *pieces)
                for block, pieces in zip(blocks, decisions)])


def _blocks(judged: list[JudgedShard], candidates_per_block: int) -> list[list[JudgedShard]]:
    """Consecutive shards grouped so that each group holds about ``candidates_per_block`` candidates at most (a
    larger shard alone)."""
    blocks: list[list[JudgedShard]] = [[]]
    in_block = 0
    for shard in judged:
        if blocks[-1] and in_block + shard.candidates > candidates_per_block:
            blocks.append([])
            in_block = 0
        blocks[-1].append(shard)
        in_block += shard.candidates
    return blocks


def _sample_filter(settings: IngestConfig) -> SampleFilter:
    return SampleFilter.from_texts(
        settings.conditions,
        min_side=settings.min_side,
        max_aspect_ratio=settings.max_aspect_ratio,
        drop_nsfw=settings.drop_nsfw,
        max_punsafe=settings.max_punsafe,
    )


def _fingerprint(settings: IngestConfig, source: IngestInput, eval_hashes: dict[str, int]) -> dict[str, Any]:
    return {
        **source.claim,
        "settings": settings.model_dump(mode="json", exclude=_SPEED_SETTINGS),
        "eval_image_hashes_sha256": hashlib.sha256(
            "".join(sorted(f"{value:016x}" for value in eval_hashes.values())).encode()
        ).hexdigest(),
    }


def _wait_for_raw_shard(layout: IngestLayout, shard_id: int, downloader: subprocess.Popen | None) -> None:
    while not layout.raw_done(shard_id).exists():
        if downloader is None or downloader.poll() is not None:
            if layout.raw_done(shard_id).exists():
                return
            code = None if downloader is None else downloader.returncode
            raise IngestError(
                f"img2dataset stopped (exit code {code}) before raw shard {shard_id} was complete; "
                f"see {layout.log}; run the same command again to resume"
            )
        time.sleep(_POLL_S)


def _finish(layout: IngestLayout, shard_count: int, input_rows: int, samples_per_shard: int) -> dict[str, Any]:
    """Joins the manifest parts into ``manifest.parquet``, one part in memory at a time, and counts them into
    ``stats.json``."""
    statuses, reasons = Counter(), Counter()
    with atomic_path(layout.manifest) as partial, pq.ParquetWriter(partial, MANIFEST_SCHEMA) as writer:
        for shard_id in range(shard_count):
            table = pq.read_table(layout.part(shard_id), schema=MANIFEST_SCHEMA).sort_by("row")
            start = shard_id * samples_per_shard
            if table.column("row").to_pylist() != list(range(start, min(start + samples_per_shard, input_rows))):
                raise IngestError(f"manifest part {layout.part(shard_id)} does not cover rows {start}.. once each")
            writer.write_table(table)
            for status, reason in zip(table.column("status").to_pylist(), table.column("reason").to_pylist()):
                statuses[status] += 1
                reasons[status, reason] += 1
    stats = {
        "input": input_rows,
        "downloaded": input_rows - statuses["failed"],
        "failed": {reason: count for (status, reason), count in sorted(reasons.items()) if status == "failed"},
        "filtered": {reason: count for (status, reason), count in sorted(reasons.items()) if status == "filtered"},
        "duplicates": statuses["duplicate"],
        "decontaminated": statuses["decontaminated"],
        "kept": statuses["kept"],
    }
    write_json(layout.stats, stats, indent=1)
    return stats


# -------------------------------------------------------------------------------------------- writing


def _write_inputs(layout: IngestLayout, source: IngestInput, samples_per_shard: int) -> None:
    """The input's rows as the shards' tasks read them (every column, one row group per shard) and a url list as
    img2dataset reads it (:func:`write_img2dataset_input`), each written once."""
    if source.url_list is not None:
        write_img2dataset_input(layout.url_input, source.url_list)
    if not layout.rows.exists():
        with atomic_path(layout.rows) as partial:
            pq.write_table(source.table, partial, row_group_size=samples_per_shard)


def write_img2dataset_input(path: Path, urls: UrlList) -> Path:
    """The url list as img2dataset reads it: ``url`` (``""`` where missing) and ``row``, written once."""
    if not path.exists():
        table = pa.table({"url": urls.download_urls(), "row": pa.array(np.arange(len(urls), dtype=np.int64))})
        write_parquet(table, path)
    return path


# ----------------------------------------------------------------------------------------- img2dataset


def img2dataset_arguments(settings: IngestConfig, url_input: Path, raw: Path, *, reencode: bool) -> dict[str, Any]:
    """img2dataset.download's arguments for the ``url``/``row`` parquet at ``url_input``.

    Args:
        settings: the ingestion settings.
        url_input: the parquet img2dataset reads.
        raw: img2dataset's output folder.
        reencode: False keeps the bodies as sent (this stage decodes them itself); True is
            img2dataset's own centre-crop resize, the baseline of ``vip bench ingest``.
    """
    return {
        "url_list": str(url_input),
        "input_format": "parquet",
        "url_col": "url",
        "save_additional_columns": ["row"],
        "output_folder": str(raw),
        "output_format": "webdataset",
        "image_size": settings.image_size,
        "resize_mode": "center_crop",
        "disable_all_reencoding": not reencode,
        "processes_count": settings.processes,
        "thread_count": settings.threads,
        "timeout": settings.timeout_s,
        "number_sample_per_shard": settings.samples_per_shard,
        "extract_exif": False,
        "compute_hash": "sha256",
        "incremental_mode": "incremental",
        "retries": 0,
        "enable_wandb": False,
        "distributor": settings.distributor,
        # img2dataset's default list refuses X-Robots-Tag noai, noimageai, noindex and noimageindex.
        "disallowed_header_directives": None if settings.respect_noai else [],
    }


def start_img2dataset(arguments: dict[str, Any], log: Path, keep_fds: tuple[int, ...] = (),
                      env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts ``img2dataset.download(**arguments)`` in a child process that logs to ``log``, inherits the file
    descriptors ``keep_fds`` and has the variables ``env`` (``RAY_ADDRESS``, for its Ray distributor) set."""
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "WANDB_MODE": "disabled", **(env or {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "tasks.stages.img2dataset_runner", json.dumps(arguments)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=keep_fds,
        )


def finish_process(process: subprocess.Popen | None) -> None:
    """Lets a child that has done its work exit by itself, interrupting it if it lingers."""
    if process is None:
        return
    try:
        process.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        stop_process(process)


def stop_process(process: subprocess.Popen | None) -> None:
    """Interrupts a running child (img2dataset then stops its pool), killing it if it does not stop."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
