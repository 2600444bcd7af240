"""The ingestion stage's work on one shard, run wherever the stage's runner puts it (this process or a Ray task).

Every function here reads and writes the stage's folder (:class:`IngestLayout`; on a cluster, a folder all
nodes share) and returns something small:

* :func:`judge_shard`: a raw img2dataset shard (or, for image files, the shard's rows of files, read here)
  becomes a *judged* shard: every row's verdict before deduplication (failed, filtered, decontaminated, or
  ``candidate`` with its hashes) and the candidates' images, centre-cropped and resized.
* :func:`load_candidates`: the hashes of the candidates of some shards, for the global deduplication.
* :func:`finalize_shards`: with the deduplication's decisions, a judged shard becomes the clean shard
  ``web-{shard:06d}.tar`` (the kept images) and its manifest part.

Each writes its files whole (:mod:`vip_core.atomic`) and last the file that marks it done, so a task run
again (after its node died, or the stage after a kill) finds its work done or starts it afresh.

Fault injection for tests: ``VIP_INJECT_INGEST_KILL=SHARD`` makes the task judging shard SHARD kill its own
process (SIGKILL) once per output folder, between writing the shard's images and its judged part.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vip_core.atomic import atomic_path
from vip_core.config import IngestConfig
from vip_core.data import storage
from vip_core.data.dedup import NOT_FOUND, HammingIndex, content_hash, perceptual_hash
from vip_core.data.filters import SampleFilter, center_crop_resize, decode_web_image
from vip_core.data.global_dedup import CONTENT_DTYPE, REASONS, Candidates, Decisions, merge_decisions
from vip_core.data.shards import encode_image, iter_samples, write_shard
from vip_core.data.urllist import clean_url

logger = logging.getLogger(__name__)

FAULT_ENV = "VIP_INJECT_INGEST_KILL"
SHARD_PREFIX = "web"
CANDIDATE = "candidate"  # a judged row waiting for the deduplication
STATUSES = ("kept", "failed", "filtered", "duplicate", "decontaminated")

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
    def judged(self) -> Path:
        return self.work / "judged"

    @property
    def parts(self) -> Path:
        return self.work / "manifest"

    @property
    def url_input(self) -> Path:
        return self.work / "urls.parquet"

    @property
    def rows(self) -> Path:
        return self.work / "rows.parquet"

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

    def judged_part(self, shard_id: int) -> Path:
        return self.judged / f"{shard_id:06d}.parquet"

    def candidates_tar(self, shard_id: int) -> Path:
        return self.judged / f"{shard_id:06d}.tar"

    def part(self, shard_id: int) -> Path:
        return self.parts / f"{shard_id:06d}.parquet"

    def clean_shard(self, shard_id: int) -> Path:
        return self.output / f"{SHARD_PREFIX}-{shard_id:06d}.tar"


@dataclass(frozen=True)
class Contamination:
    """The evaluation images: an index of their perceptual hashes and their names (paths), in the same order."""

    index: HammingIndex
    labels: tuple[str, ...]

    def matches(self, phashes: list[int]) -> list[str | None]:
        """For each hash, the name of the first evaluation image within the index's distance, else None."""
        found = self.index.earliest(np.array(phashes, dtype=np.uint64)).tolist()
        return [None if position == NOT_FOUND else self.labels[position] for position in found]


@dataclass(frozen=True)
class ShardWork:
    """What every shard's task needs: the folder, the settings, the filters, the evaluation images (or None),
    the input's location and caption columns, the URL the clean shards go to (or None) and where the images
    come from: img2dataset's raw shards, or the files below ``images``."""

    layout: IngestLayout
    settings: IngestConfig
    sample_filter: SampleFilter
    contamination: Contamination | None
    url_column: str
    caption_column: str | None
    upload_to: str | None = None  # the URL each clean shard is uploaded to once written, if any
    fault_shard: int | None = None  # FAULT_ENV, read where the stage starts
    images: str | None = None  # the folder (or URL) that the rows' ``path`` is relative to; None: a url list


class Fetched(NamedTuple):
    """One input row's image as fetched: its row number, key, where it came from (None: the row names nothing),
    its bytes, why there are none (a failure reason) and their sha256 when the fetcher computed it."""

    row: int
    key: str
    url: str | None
    body: bytes | None
    failure: str | None
    sha256: str | None = None


class JudgedShard(NamedTuple):
    """A judged shard: its number, its first key as a number (keys grow with the row) and its candidates."""

    shard_id: int
    first_id: int
    candidates: int


# ------------------------------------------------------------------------------------------------- judging


def judge_shard(work: ShardWork, shard_id: int) -> JudgedShard:
    """Judges raw shard ``shard_id``: writes its candidates' images, then its judged part; removes the raw tar.
    Holds one decoded image at a time, and the candidates' resized images."""
    layout = work.layout
    if not layout.judged_part(shard_id).exists():
        rows = pq.ParquetFile(layout.rows).read_row_group(shard_id).to_pylist()
        first_row = shard_id * work.settings.samples_per_shard
        fetched = _read_files(work, rows, first_row) if work.images else _downloaded(work, shard_id, rows, first_row)
        judged = [_judge(work, item, row) for item, row in fetched]
        _decontaminate(work, [record for record, _ in judged])
        write_shard(layout.candidates_tar(shard_id),
                    [(record["key"], fields) for record, fields in judged if record["status"] == CANDIDATE])
        _maybe_kill(work, shard_id)
        write_parquet(pa.Table.from_pylist([record for record, _ in judged], schema=MANIFEST_SCHEMA),
                      layout.judged_part(shard_id))
        layout.raw_tar(shard_id).unlink(missing_ok=True)
    table = pq.read_table(layout.judged_part(shard_id), columns=["key", "status"])
    candidates = pc.sum(pc.equal(table.column("status"), CANDIDATE)).as_py() or 0
    return JudgedShard(shard_id, min(int(key) for key in table.column("key").to_pylist()), candidates)


def fault_shard() -> int | None:
    """The shard whose judging task kills itself once (``VIP_INJECT_INGEST_KILL``), or None."""
    spec = os.environ.get(FAULT_ENV, "").strip()
    if not spec:
        return None
    if not spec.isdigit():
        raise ValueError(f"{FAULT_ENV} must be a shard number, got {spec!r}")
    return int(spec)


def _maybe_kill(work: ShardWork, shard_id: int) -> None:
    marker = work.layout.work / "fault-injected"
    if work.fault_shard != shard_id or marker.exists():
        return
    marker.write_text(f"killed while judging shard {shard_id}\n")
    logger.warning("fault injection: killing the process (pid %d) judging shard %d", os.getpid(), shard_id)
    os.kill(os.getpid(), signal.SIGKILL)


def _downloaded(work: ShardWork, shard_id: int, rows: list[dict[str, Any]], first_row: int
                ) -> Iterator[tuple[Fetched, dict[str, Any]]]:
    """Each row of raw shard ``shard_id`` as img2dataset fetched it, in key order, with its url-list row."""
    layout = work.layout
    bodies = {sample["__key__"]: sample.get("jpg", b"") for sample in iter_samples([layout.raw_tar(shard_id)])}
    for item in sorted(pq.read_table(layout.raw_meta(shard_id)).to_pylist(), key=lambda item: item["key"]):
        row = rows[int(item["row"]) - first_row]
        url, body = clean_url(row.get(work.url_column)), bodies.pop(item["key"], None)
        failure = "no_url" if url is None else None
        if failure is None and (item["status"] != "success" or body is None):
            failure = failure_reason(item.get("error_message"))
        yield Fetched(int(item["row"]), item["key"], url, body, failure, item.get("sha256")), row


def _read_files(work: ShardWork, rows: list[dict[str, Any]], first_row: int) -> Iterator[tuple[Fetched, dict[str, Any]]]:
    """Each row's file read from below ``work.images``, one at a time; a file that cannot be read is
    ``unreadable``."""
    for offset, row in enumerate(rows):
        location = str(storage.join(work.images, row["path"]))
        try:
            with storage.open_binary(location) as handle:
                body, failure = handle.read(), None
        except OSError as error:
            logger.warning("unreadable image file %s: %s", location, error)
            body, failure = None, "unreadable"
        yield Fetched(first_row + offset, row["key"], location, body, failure), row


def _judge(work: ShardWork, item: Fetched, row: dict[str, Any]) -> tuple[dict, dict | None]:
    """One fetched row's record (failed, filtered, or a candidate with its hashes) and, for a candidate, its
    sample's fields (the image centre-cropped, resized and encoded, and its metadata)."""
    record = {"row": item.row, "key": item.key, "url": item.url}
    if item.failure is not None:
        return _verdict(record, "failed", item.failure), None
    settings = work.settings
    image, reason = decode_web_image(item.body, settings.max_image_pixels, draft_size=settings.image_size)
    if image is None:
        return _verdict(record, "failed", reason), None
    width, height = image.info["original_size"]
    record.update(original_width=width, original_height=height, sha256=item.sha256 or content_hash(item.body))
    reason = work.sample_filter.reason(row, width, height)
    if reason is not None:
        return _verdict(record, "filtered", reason), None
    record["phash"] = f"{perceptual_hash(image):016x}"
    record = _verdict(record, CANDIDATE, None)
    return record, _sample_fields(work, record, row, image)


def _decontaminate(work: ShardWork, records: list[dict[str, Any]]) -> None:
    """Marks the candidates near an evaluation image ``decontaminated``, naming it."""
    candidates = [record for record in records if record["status"] == CANDIDATE]
    if work.contamination is None or not candidates:
        return
    for record, label in zip(candidates, work.contamination.matches([int(r["phash"], 16) for r in candidates])):
        if label is not None:
            record.update(status="decontaminated", reason="evaluation_image", duplicate_of=label)


def _sample_fields(work: ShardWork, record: dict[str, Any], row: dict[str, Any], image) -> dict[str, Any]:
    meta = {
        **row,
        "url": record["url"],
        "caption": row.get(work.caption_column) if work.caption_column else None,
        "source_row": record["row"],
        "key": record["key"],
        "original_width": record["original_width"],
        "original_height": record["original_height"],
        "sha256": record["sha256"],
        "phash": record["phash"],
    }
    return {"jpg": encode_image(center_crop_resize(image, work.settings.image_size)), "json": meta}


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


# ------------------------------------------------------------------------------------ deduplication's input


def load_candidates(layout: IngestLayout, shard_ids: list[int]) -> Candidates:
    """The candidates of judged shards ``shard_ids``: their keys as numbers (the order of the rows), the first 32
    hex digits of their sha256 and their perceptual hashes."""
    tables = [pq.read_table(layout.judged_part(shard), columns=["key", "status", "sha256", "phash"])
              for shard in shard_ids]
    table = pa.concat_tables(tables).filter(pc.equal(pc.field("status"), CANDIDATE))
    ids = np.array([int(key) for key in table.column("key").to_pylist()], dtype=np.int64)
    content = pc.cast(pc.utf8_slice_codeunits(table.column("sha256"), 0, 32), pa.binary(32)).combine_chunks()
    content = np.frombuffer(content.buffers()[1], dtype=CONTENT_DTYPE, count=len(ids)) if len(ids) else []
    phash = np.array([int(value, 16) for value in table.column("phash").to_pylist()], dtype=np.uint64)
    return Candidates(ids, np.array(content, dtype=CONTENT_DTYPE), phash)


# ----------------------------------------------------------------------------------------------- finishing


def finalize_shards(work: ShardWork, shard_ids: list[int], *pieces: Decisions) -> None:
    """Writes the clean shard and the manifest part of each of ``shard_ids`` not finished yet, from the
    deduplication's decisions of their candidates (the pieces of every partition)."""
    decisions = merge_decisions(*pieces)
    for shard_id in shard_ids:
        if not work.layout.part(shard_id).exists():
            _finalize(work.layout, shard_id, decisions, work.upload_to)


def _finalize(layout: IngestLayout, shard_id: int, decisions: Decisions, upload_to: str | None) -> None:
    records = pq.read_table(layout.judged_part(shard_id), schema=MANIFEST_SCHEMA).to_pylist()
    width = len(records[0]["key"])
    shard = layout.clean_shard(shard_id)
    for record in records:
        if record["status"] == CANDIDATE:
            _apply(record, decisions, width, shard.name)
    kept = {record["key"] for record in records if record["status"] == "kept"}
    samples = [(sample["__key__"], {name: value for name, value in sample.items() if not name.startswith("__")})
               for sample in iter_samples([layout.candidates_tar(shard_id)]) if sample["__key__"] in kept]
    if samples:
        write_shard(shard, samples)
        if upload_to is not None:
            storage.put([shard], upload_to)
    write_parquet(pa.Table.from_pylist(records, schema=MANIFEST_SCHEMA), layout.part(shard_id))
    layout.candidates_tar(shard_id).unlink(missing_ok=True)
    logger.info("shard %d: %s", shard_id, dict(Counter(record["status"] for record in records)))


def _apply(record: dict[str, Any], decisions: Decisions, key_width: int, shard_name: str) -> None:
    """A candidate's record once decided: kept (in ``shard_name``), or a duplicate naming the kept key it repeats."""
    at = int(np.searchsorted(decisions.ids, int(record["key"])))
    if at < len(decisions.ids) and decisions.ids[at] == int(record["key"]):
        record.update(status="duplicate", reason=REASONS[int(decisions.reasons[at])],
                      duplicate_of=f"{int(decisions.duplicate_of[at]):0{key_width}d}")
    else:
        record.update(status="kept", shard=shard_name)


def write_parquet(table: pa.Table, path: Path) -> None:
    with atomic_path(path) as partial:
        pq.write_table(table, partial)
