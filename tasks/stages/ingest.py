"""Web-image ingestion: a LAION-format url list to clean webdataset shards.

img2dataset downloads the rows into raw shards (bodies kept as sent, no re-encoding) in a child
process; meanwhile this process cleans each raw shard as soon as img2dataset finishes it: decode,
filter, decontaminate against the evaluation images, deduplicate, then centre-crop, resize and write
``web-{shard:06d}.tar`` named after its raw shard. Layout of the output folder::

    web-000000.tar ...      clean shards (key.jpg + key.json), readable by vip_core.data.shards
    manifest.parquet        one row per input row: status (kept, failed, filtered, duplicate,
                            decontaminated), reason, hashes, the clean shard that holds it
    stats.json              {"input", "downloaded", "failed", "filtered", "duplicates", "decontaminated", "kept"}
    stage.json              the stage folder's claim: url list, settings, evaluation images (tasks.runtime.folders)
    _ingest/                state: the url list as img2dataset reads it, raw
                            shards, per-shard manifest parts, img2dataset's log

Resuming: img2dataset's incremental mode skips raw shards it finished (their ``*_stats.json``); a raw
shard is cleaned again unless its manifest part exists, and the part is written only after its clean
shard, each atomically. Cleaning is in shard order, so duplicates resolve the same way every time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.runtime.folders import StageFolder, eval_data_copy, identity
from vip_core.atomic import atomic_path, write_json
from vip_core.config import IngestConfig, VipConfig
from vip_core.data.dedup import Deduplicator, NearDuplicateIndex, build_contamination_index, content_hash, perceptual_hash
from vip_core.data.filters import SampleFilter, center_crop_resize, decode_web_image
from vip_core.data import storage
from vip_core.data.shards import encode_image, iter_samples, list_shards, write_shard
from vip_core.data.urllist import UrlList, file_digest, read_url_list
from tasks.runtime.environment import configure_environment, state_paths

logger = logging.getLogger(__name__)

SHARD_PREFIX = "web"
STATUSES = ("kept", "failed", "filtered", "duplicate", "decontaminated")
# Settings that change speed only: a resumed run may change them.
_SPEED_SETTINGS = {"processes", "threads", "timeout_s"}
_POLL_S = 0.1
_STOP_GRACE_S = 20.0

MANIFEST_SCHEMA = pa.schema(
    [
        ("row", pa.int64()),
        ("key", pa.string()),
        ("url", pa.string()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("shard", pa.string()),
        ("sha256", pa.string()),
        ("phash", pa.string()),
        ("original_width", pa.int64()),
        ("original_height", pa.int64()),
        ("duplicate_of", pa.string()),
    ]
)


class IngestError(RuntimeError):
    """The download stage stopped before finishing; running the same command again resumes it."""


@dataclass(frozen=True)
class IngestLayout:
    """The paths of one ingestion output folder."""

    output: Path

    @property
    def work(self) -> Path:
        return self.output / "_ingest"

    @property
    def raw(self) -> Path:
        return self.work / "raw"

    @property
    def parts(self) -> Path:
        return self.work / "manifest"

    @property
    def url_input(self) -> Path:
        return self.work / "urls.parquet"

    @property
    def log(self) -> Path:
        return self.work / "img2dataset.log"

    @property
    def manifest(self) -> Path:
        return self.output / "manifest.parquet"

    @property
    def stats(self) -> Path:
        return self.output / "stats.json"

    def raw_done(self, shard_id: int) -> Path:
        return self.raw / f"{shard_id:05d}_stats.json"

    def raw_meta(self, shard_id: int) -> Path:
        return self.raw / f"{shard_id:05d}.parquet"

    def raw_tar(self, shard_id: int) -> Path:
        return self.raw / f"{shard_id:05d}.tar"

    def part(self, shard_id: int) -> Path:
        return self.parts / f"{shard_id:06d}.parquet"

    def clean_shard(self, shard_id: int) -> Path:
        return self.output / f"{SHARD_PREFIX}-{shard_id:06d}.tar"


# ------------------------------------------------------------------------------------------------ task


def run_ingest(
    config: VipConfig, url_list: str | Path, output: str | Path, eval_images: str | Path | None = None
) -> dict[str, Any]:
    """Downloads, filters, deduplicates and decontaminates a url list into clean shards in ``output``.

    Args:
        config: the run's configuration; ``config.data.ingest`` drives this stage.
        url_list: a LAION-format parquet, csv or jsonl file.
        output: the folder for the clean shards, ``manifest.parquet`` and ``stats.json``: a local path, or an
            fsspec URL (``s3://bucket/web``), where the finished shards, manifest and stats are uploaded from
            a local staging folder (``$VIP_HOME/data/staging/…``, which keeps the work for a re-run).
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
    if storage.is_url(output):
        staged = run_ingest(config, url_list, staging_folder(str(output)), eval_images)
        files = [Path(staged["output"]) / name for name in ("manifest.parquet", "stats.json")]
        storage.put(list_shards(staged["output"], SHARD_PREFIX) + files, str(output))
        return {**staged, "output": str(output), "staging": staged["output"]}
    settings = config.data.ingest
    urls = read_url_list(url_list)
    sample_filter = _sample_filter(settings)
    urls.check_conditions(sample_filter.conditions)
    contamination, eval_hashes = _contamination_index(eval_images, settings.decontaminate_max_distance)
    layout = IngestLayout(Path(output).resolve())
    with exclusive_use(layout) as lock:
        StageFolder(layout.output, "ingest", _fingerprint(settings, urls, eval_hashes)).claim()
        for folder in (layout.raw, layout.parts):
            folder.mkdir(parents=True, exist_ok=True)
        shard_count = math.ceil(len(urls) / settings.samples_per_shard)
        cleaner = ShardCleaner(layout, urls, settings, sample_filter, contamination)
        write_img2dataset_input(layout.url_input, urls.urls())
        _download_and_clean(layout, settings, cleaner, shard_count, lock)
        stats = _finish(layout, shard_count, len(urls))
    return {**stats, "output": str(layout.output), "shards": len(list_shards(layout.output, SHARD_PREFIX))}


def _contamination_index(
    eval_images: str | Path | None, max_distance: int
) -> tuple[NearDuplicateIndex | None, dict[str, int]]:
    """The near-duplicate index of the evaluation images and their hashes (a URL's images copied once, as the
    evaluation jobs' data are); none without evaluation images."""
    if not eval_images:
        return None, {}
    with eval_data_copy(str(eval_images), identity(eval_images)) as local:
        return build_contamination_index(local, max_distance)


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


def _download_and_clean(
    layout: IngestLayout, settings: IngestConfig, cleaner: "ShardCleaner", shard_count: int, lock: int
) -> None:
    """Runs img2dataset on the shards not yet downloaded while cleaning every shard in order."""
    downloader = None if _all_downloaded(layout, shard_count) else start_img2dataset(
        img2dataset_arguments(settings, layout.url_input, layout.raw, reencode=False), layout.log, keep_fds=(lock,)
    )
    try:
        for shard_id in range(shard_count):
            if layout.part(shard_id).exists():
                cleaner.remember(_read_part(layout.part(shard_id)))
                continue
            _wait_for_raw_shard(layout, shard_id, downloader)
            cleaner.clean(shard_id)
    except BaseException:
        stop_process(downloader)
        raise
    finish_process(downloader)


def _sample_filter(settings: IngestConfig) -> SampleFilter:
    return SampleFilter.from_texts(
        settings.conditions,
        min_side=settings.min_side,
        max_aspect_ratio=settings.max_aspect_ratio,
        drop_nsfw=settings.drop_nsfw,
        max_punsafe=settings.max_punsafe,
    )


def _fingerprint(settings: IngestConfig, urls: UrlList, eval_hashes: dict[str, int]) -> dict[str, Any]:
    return {
        "url_list_sha256": file_digest(urls.path),
        "settings": settings.model_dump(mode="json", exclude=_SPEED_SETTINGS),
        "eval_image_hashes_sha256": hashlib.sha256(
            "".join(sorted(f"{value:016x}" for value in eval_hashes.values())).encode()
        ).hexdigest(),
    }


def _all_downloaded(layout: IngestLayout, shard_count: int) -> bool:
    return all(layout.part(i).exists() or layout.raw_done(i).exists() for i in range(shard_count))


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


def _finish(layout: IngestLayout, shard_count: int, input_rows: int) -> dict[str, Any]:
    table = pa.concat_tables([pq.read_table(layout.part(i), schema=MANIFEST_SCHEMA) for i in range(shard_count)])
    table = table.sort_by("row")
    if table.num_rows != input_rows or table.column("row").to_pylist() != list(range(input_rows)):
        raise IngestError(f"the manifest parts in {layout.parts} do not cover the {input_rows} input rows once each")
    _write_parquet(table, layout.manifest)
    stats = stats_from_manifest(table.select(["status", "reason"]).to_pylist())
    write_json(layout.stats, stats, indent=1)
    return stats


def stats_from_manifest(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The stage's counts from manifest records (``status`` and ``reason``). They add up:
    input = downloaded + sum(failed); downloaded = sum(filtered) + duplicates + decontaminated + kept."""
    records = list(records)
    counts = Counter(record["status"] for record in records)
    failed = Counter(record["reason"] for record in records if record["status"] == "failed")
    filtered = Counter(record["reason"] for record in records if record["status"] == "filtered")
    return {
        "input": len(records),
        "downloaded": len(records) - counts["failed"],
        "failed": dict(sorted(failed.items())),
        "filtered": dict(sorted(filtered.items())),
        "duplicates": counts["duplicate"],
        "decontaminated": counts["decontaminated"],
        "kept": counts["kept"],
    }


# ------------------------------------------------------------------------------------ cleaning a shard


class ShardCleaner:
    """Turns raw img2dataset shards into clean shards and manifest parts, one shard at a time, in order.

    Args:
        layout: the output folder's paths.
        urls: the url list (its rows feed the filters and each sample's json).
        settings: the ingestion settings.
        sample_filter: the filters.
        contamination: perceptual hashes of the evaluation images, or None.
    """

    def __init__(
        self,
        layout: IngestLayout,
        urls: UrlList,
        settings: IngestConfig,
        sample_filter: SampleFilter,
        contamination: NearDuplicateIndex | None,
    ) -> None:
        self.layout = layout
        self.rows = urls.rows()
        self.urls = urls.urls()
        self.caption_column = urls.caption_column
        self.settings = settings
        self.sample_filter = sample_filter
        self.contamination = contamination
        self.dedup = Deduplicator(settings.phash_max_distance)

    def remember(self, records: list[dict[str, Any]]) -> None:
        """Adds the kept samples of a shard cleaned earlier to the duplicate index."""
        for record in records:
            if record["status"] == "kept":
                self.dedup.add(record["key"], record["sha256"], int(record["phash"], 16))

    def clean(self, shard_id: int) -> None:
        """Cleans raw shard ``shard_id``: writes its clean shard, then its manifest part."""
        layout = self.layout
        bodies = {sample["__key__"]: sample.get("jpg", b"") for sample in iter_samples([layout.raw_tar(shard_id)])}
        downloads = sorted(pq.read_table(layout.raw_meta(shard_id)).to_pylist(), key=lambda item: item["key"])
        records, samples = [], []
        for item in downloads:
            record, sample = self._judge(item, bodies.get(item["key"]))
            records.append(record)
            if sample is not None:
                samples.append(sample)
        shard = layout.clean_shard(shard_id)
        if samples:
            write_shard(shard, samples)
        for record in records:
            record["shard"] = shard.name if record["status"] == "kept" else None
        _write_parquet(pa.Table.from_pylist(records, schema=MANIFEST_SCHEMA), layout.part(shard_id))
        layout.raw_tar(shard_id).unlink(missing_ok=True)
        logger.info("shard %d: %s", shard_id, dict(Counter(record["status"] for record in records)))

    def _judge(self, item: dict[str, Any], body: bytes | None) -> tuple[dict[str, Any], tuple[str, dict] | None]:
        row_index = int(item["row"])
        record = {"row": row_index, "key": item["key"], "url": self.urls[row_index]}
        if record["url"] is None:
            return _verdict(record, "failed", "no_url"), None
        if item["status"] != "success" or body is None:
            return _verdict(record, "failed", failure_reason(item.get("error_message"))), None
        image, reason = decode_web_image(body, self.settings.max_image_pixels, draft_size=self.settings.image_size)
        if image is None:
            return _verdict(record, "failed", reason), None
        width, height = image.info["original_size"]
        record.update(original_width=width, original_height=height, sha256=item.get("sha256") or content_hash(body))
        reason = self.sample_filter.reason(self.rows[row_index], width, height)
        if reason is not None:
            return _verdict(record, "filtered", reason), None
        phash = perceptual_hash(image)
        record["phash"] = f"{phash:016x}"
        evaluation_image = self.contamination.find(phash) if self.contamination is not None else None
        if evaluation_image is not None:
            return _verdict(record, "decontaminated", "evaluation_image", evaluation_image), None
        duplicate = self.dedup.duplicate_of(record["sha256"], phash)
        if duplicate is not None:
            return _verdict(record, "duplicate", *duplicate), None
        self.dedup.add(record["key"], record["sha256"], phash)
        return _verdict(record, "kept", None), (record["key"], self._sample_fields(record, image))

    def _sample_fields(self, record: dict[str, Any], image) -> dict[str, Any]:
        row = self.rows[record["row"]]
        meta = {
            **{name: value for name, value in row.items()},
            "url": record["url"],
            "caption": row.get(self.caption_column) if self.caption_column else None,
            "source_row": record["row"],
            "key": record["key"],
            "original_width": record["original_width"],
            "original_height": record["original_height"],
            "sha256": record["sha256"],
            "phash": record["phash"],
        }
        return {"jpg": encode_image(center_crop_resize(image, self.settings.image_size)), "json": meta}


def _verdict(record: dict[str, Any], status: str, reason: str | None, duplicate_of: str | None = None) -> dict[str, Any]:
    return {**record, "status": status, "reason": reason, "duplicate_of": duplicate_of}


def failure_reason(error_message: str | None) -> str:
    """Maps img2dataset's per-sample error string to a short failure reason."""
    text = (error_message or "").lower()
    if "x-robots-tag" in text:
        return "noai"
    if "redirect" in text:
        return "redirect"
    status = re.search(r"http error (\d{3})", text)
    if status:
        return f"http_{status.group(1)}"
    if "timed out" in text or "timeout" in text:
        return "timeout"
    if "incompleteread" in text or "truncated" in text:
        return "truncated"
    if "unknown url type" in text or "no host given" in text or "control characters" in text:
        return "bad_url"
    if "connection" in text or "errno" in text or "remote end closed" in text:
        return "connection_error"
    return "download_error"


# -------------------------------------------------------------------------------------------- writing


def write_img2dataset_input(path: Path, urls: list[str | None]) -> Path:
    """The url list as img2dataset reads it: ``url`` ("" where missing) and ``row``, written once."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        table = pa.table({"url": [url or "" for url in urls], "row": pa.array(range(len(urls)), pa.int64())})
        _write_parquet(table, path)
    return path


def _write_parquet(table: pa.Table, path: Path) -> None:
    with atomic_path(path) as partial:
        pq.write_table(table, partial)


def _read_part(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path, schema=MANIFEST_SCHEMA).to_pylist()


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
        "distributor": "multiprocessing",
        # img2dataset's default list refuses X-Robots-Tag noai, noimageai, noindex and noimageindex.
        "disallowed_header_directives": None if settings.respect_noai else [],
    }


def start_img2dataset(arguments: dict[str, Any], log: Path, keep_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Starts ``img2dataset.download(**arguments)`` in a child process that logs to ``log`` and inherits
    the file descriptors ``keep_fds``."""
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "WANDB_MODE": "disabled"}
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
