"""``vip bench ingest``: images/s of the whole ingestion stage against img2dataset alone, in the same run.

Both sides fetch the same url list of sample photographs from the same server on 127.0.0.1, which runs
in its own process with every photograph made beforehand. img2dataset alone downloads, centre-crops
and resizes into webdataset shards with the stage's image size, processes, threads and shard size, and
without EXIF extraction, as the stage runs it. The stage (``run_ingest``) is that download, without
img2dataset's re-encoding, plus decoding, filtering, hashing, deduplication, decontamination against
``--eval-images`` evaluation images, resizing and writing the clean shards, the manifest and the stats.
The sides alternate, ``--repeats`` times each; the best pass of each counts. Rates are input rows per
second of wall time from start to finish, process start-up included. ``clean_images_per_cpu_s`` is the rows the
stage cleans (decodes, filters, hashes, decontaminates, deduplicates, resizes and writes) per CPU-second of its
own process, img2dataset's processes left out: what one core cleans, whatever the download's pace.

The global deduplication alone (:func:`bench_dedup`) is timed on synthetic candidates at two sizes, each in a
fresh local Ray on this machine, as the stage runs it with ``distributor: ray``: random 64-bit perceptual hashes
(uniform, unlike real ones, which cluster), with a share of them exact copies and near copies (1 to
``max_distance`` bits flipped) of others. The candidates are made by Ray tasks first (untimed); the time is from
the first step to every decision computed. The peak memory is the largest peak resident set (``VmHWM``) of any Ray
worker process of the run, beside that of a worker that has run one empty task.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

TARGET_OVERHEAD = 0.20
TARGET_DEDUP_MEMORY_RATIO = 2.0  # 4x the hashes: under 2x the largest worker's peak
TARGET_DEDUP_TIME_RATIO = 6.0  # 4x the hashes: under 6x the time


def bench_ingest(*, num_images: int, max_side: int, image_size: int, processes: int, threads: int,
                 samples_per_shard: int, eval_images: int, repeats: int, dedup_hashes: tuple[int, int],
                 rows_per_partition: int, duplicate_share: float) -> dict[str, Any]:
    """Best-of-``repeats`` images/s of img2dataset alone and of the stage on one url list; the overhead; the
    deduplication alone at two sizes.

    Args:
        num_images: rows in the url list.
        max_side: longer side of the served photographs.
        image_size, processes, threads, samples_per_shard: the stage's settings (``data.ingest``).
        eval_images: evaluation images the stage decontaminates against.
        repeats: passes of each side; the best counts.
        dedup_hashes: the two numbers of synthetic candidates the deduplication is timed on.
        rows_per_partition: the deduplication's partition size (``data.ingest.rows_per_partition``).
        duplicate_share: the share of the synthetic candidates that copy another.
    """
    from tasks.fixtures.web import laion_row, photo_path, sample_photo, write_url_list
    from vip_core.config import get_preset, with_overrides

    settings = {
        "image_size": image_size, "processes": processes, "threads": threads,
        "samples_per_shard": samples_per_shard, "min_side": 16, "timeout_s": 30.0,
    }
    config = with_overrides(get_preset("tiny"), {f"data.ingest.{key}": value for key, value in settings.items()})
    with tempfile.TemporaryDirectory(prefix="vip-bench-ingest-") as folder:
        work = Path(folder)
        url, stop = _serve_in_process(work / "web", num_images, max_side)
        try:
            url_list = write_url_list(
                work / "laion.parquet", [laion_row(url + photo_path(i), f"photo {i}") for i in range(num_images)]
            )
            eval_folder = work / "eval"
            eval_folder.mkdir()
            for index in range(eval_images):
                sample_photo(1_000_000 + index, 128).save(eval_folder / f"{index}.png")
            baseline, stage = [], []
            for attempt in range(repeats):
                baseline.append(_time_img2dataset(config, url_list, work / f"alone-{attempt}"))
                stage.append(_time_stage(config, url_list, work / f"stage-{attempt}", eval_folder))
        finally:
            stop()
    baseline_rate = num_images / min(baseline)
    stage_seconds, clean_cpu_s = min(stage)
    stage_rate = num_images / stage_seconds
    overhead = baseline_rate / stage_rate - 1
    return {
        "benchmark": "ingest", "num_images": num_images, "served_max_side": max_side,
        "image_size": image_size, "processes": processes, "threads": threads,
        "samples_per_shard": samples_per_shard, "eval_images": eval_images, "repeats": repeats,
        "img2dataset_seconds": round(min(baseline), 2), "stage_seconds": round(stage_seconds, 2),
        "img2dataset_images_per_s": round(baseline_rate, 2), "stage_images_per_s": round(stage_rate, 2),
        "clean_cpu_s": round(clean_cpu_s, 2), "clean_images_per_cpu_s": round(num_images / clean_cpu_s, 1),
        "overhead": round(overhead, 4), "target_overhead": TARGET_OVERHEAD, "meets_target": overhead < TARGET_OVERHEAD,
        **_dedup_figures(dedup_hashes, rows_per_partition, duplicate_share, config.data.ingest.phash_max_distance),
    }


def _time_img2dataset(config: Any, url_list: Path, folder: Path) -> float:
    from tasks.stages.ingest import finish_process, img2dataset_arguments, start_img2dataset, write_img2dataset_input
    from vip_core.data.urllist import read_url_list

    started = time.perf_counter()
    url_input = write_img2dataset_input(folder / "urls.parquet", read_url_list(url_list))
    arguments = img2dataset_arguments(config.data.ingest, url_input, folder / "raw", reencode=True)
    process = start_img2dataset(arguments, folder / "img2dataset.log")
    process.wait()
    seconds = time.perf_counter() - started
    finish_process(process)
    if process.returncode != 0:
        raise RuntimeError(f"img2dataset failed (exit code {process.returncode}); see {folder / 'img2dataset.log'}")
    return seconds


def _time_stage(config: Any, url_list: Path, folder: Path, eval_folder: Path) -> tuple[float, float]:
    """The stage's wall seconds and the CPU seconds of this process (the cleaning; img2dataset is a child)."""
    from tasks.stages.ingest import run_ingest

    started, cpu = time.perf_counter(), _own_cpu_s()
    stats = run_ingest(config, url_list, folder, eval_images=eval_folder)
    seconds, cpu = time.perf_counter() - started, _own_cpu_s() - cpu
    if stats["kept"] + stats["duplicates"] + stats["decontaminated"] == 0:
        raise RuntimeError(f"the stage kept nothing: {stats}")
    return seconds, cpu


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _dedup_figures(sizes: tuple[int, int], rows_per_partition: int, duplicate_share: float,
                   max_distance: int) -> dict[str, Any]:
    """The deduplication at the two sizes, with the ratios of the larger to the smaller."""
    small, large = (bench_dedup(hashes=size, rows_per_partition=rows_per_partition, duplicate_share=duplicate_share,
                                max_distance=max_distance) for size in sizes)
    memory_ratio = large["peak_mb"] / small["peak_mb"]
    time_ratio = large["seconds"] / small["seconds"]
    figures = {"dedup_rows_per_partition": rows_per_partition, "dedup_duplicate_share": duplicate_share,
               "dedup_max_distance": max_distance}
    for name, run in (("small", small), ("large", large)):
        figures.update({f"dedup_hashes_{name}": run["hashes"], f"dedup_s_{name}": run["seconds"],
                        f"dedup_peak_mb_{name}": run["peak_mb"], f"dedup_idle_worker_mb_{name}": run["idle_worker_mb"],
                        f"dedup_partitions_{name}": run["partitions"], f"dedup_duplicates_{name}": run["duplicates"]})
    return {
        **figures,
        "dedup_size_ratio": round(large["hashes"] / small["hashes"], 2),
        "dedup_time_ratio": round(time_ratio, 3), "dedup_memory_ratio": round(memory_ratio, 3),
        "target_dedup_time_ratio": TARGET_DEDUP_TIME_RATIO, "target_dedup_memory_ratio": TARGET_DEDUP_MEMORY_RATIO,
        "dedup_meets_target": time_ratio < TARGET_DEDUP_TIME_RATIO and memory_ratio < TARGET_DEDUP_MEMORY_RATIO,
    }


def bench_dedup(*, hashes: int, rows_per_partition: int, duplicate_share: float, max_distance: int) -> dict[str, Any]:
    """Seconds and the largest Ray worker's peak private memory of the global deduplication of ``hashes``
    synthetic candidates, in a local Ray of this machine's CPUs (one CPU a task)."""
    from tasks.runtime.runner import RayRunner
    from tasks.runtime.ray_session import ray_session
    from vip_core.data.global_dedup import deduplicate, partition_count

    os.environ.pop("RAY_ADDRESS", None)  # this machine's figures
    with ray_session(num_workers=1, cpus_per_worker=1.0):
        runner = RayRunner(cpus=1.0)
        with WorkerMemory() as idle:
            runner.get([runner.submit(_nothing)])
        chunks = [runner.submit(synthetic_candidates, start, min(rows_per_partition, hashes - start), duplicate_share,
                                max_distance) for start in range(0, hashes, rows_per_partition)]
        runner.wait(chunks)
        with WorkerMemory() as memory:
            started = time.perf_counter()
            pieces = deduplicate(runner, chunks, candidates=hashes, max_distance=max_distance,
                                 rows_per_partition=rows_per_partition)
            duplicates = sum(runner.get([runner.submit(_count, piece) for piece in pieces[0]]))
            seconds = time.perf_counter() - started
    return {"hashes": hashes, "seconds": round(seconds, 2), "peak_mb": round(memory.peak_mb, 1),
            "idle_worker_mb": round(idle.peak_mb, 1), "partitions": partition_count(hashes, rows_per_partition),
            "duplicates": duplicates}


class WorkerMemory:
    """Samples, every ``interval`` seconds while the block runs, the private resident memory (``RssAnon``: not
    the object store's shared pages a worker reads) of the Ray worker processes this process started, and
    keeps the largest (``peak_mb``)."""

    def __init__(self, interval: float = 0.02) -> None:
        import threading

        self.interval = interval
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="vip-worker-memory", daemon=True)

    def __enter__(self) -> "WorkerMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        workers, listed = [], 0.0
        while True:
            if time.monotonic() - listed > 0.5:  # workers come and go
                workers, listed = _ray_workers(), time.monotonic()
            for pid in workers:
                self.peak_mb = max(self.peak_mb, _private_mb(pid))
            if self._stop.wait(self.interval):
                return


def synthetic_candidates(start: int, count: int, duplicate_share: float, max_distance: int):
    """Candidates ``start .. start + count - 1``: random content and perceptual hashes, then a share of them
    replaced by copies of earlier ones of the chunk, half exact (same content and hash) and half near (another
    content, 1 to ``max_distance`` bits of the hash flipped)."""
    from vip_core.data.global_dedup import CONTENT_DTYPE, Candidates

    rng = np.random.default_rng(start)
    content = rng.integers(0, 16, (count, CONTENT_DTYPE.itemsize), dtype=np.uint8)  # [n, 32] hex digits
    content = np.frombuffer(np.frombuffer(b"0123456789abcdef", np.uint8)[content].tobytes(), dtype=CONTENT_DTYPE).copy()
    phash = rng.integers(0, np.iinfo(np.uint64).max, count, dtype=np.uint64, endpoint=True)
    copies = np.flatnonzero(rng.random(count) < duplicate_share)
    copies = copies[copies > 0]
    source = (rng.random(len(copies)) * copies).astype(np.int64)  # an earlier candidate of the chunk
    exact = rng.random(len(copies)) < 0.5
    content[copies[exact]] = content[source[exact]]
    flips = np.zeros(len(copies), dtype=np.uint64)
    for _ in range(max(max_distance, 1)):
        bit = rng.integers(0, 64, len(copies)).astype(np.uint64)
        flips |= np.where(rng.random(len(copies)) < 0.5, np.uint64(1) << bit, np.uint64(0))
    flips[~exact & (flips == 0)] = 1
    phash[copies] = phash[source] ^ np.where(exact, np.uint64(0), flips)
    return Candidates(np.arange(start, start + count, dtype=np.int64), content, phash)


def _nothing() -> None:
    return None


def _count(decisions) -> int:
    return len(decisions.ids)


def _ray_workers() -> list[int]:
    """The process ids of the Ray workers this process started (named ``ray::IDLE`` or ``ray::<task>`` by Ray;
    its agents, ``ray::…Agent``, left out)."""
    import psutil

    workers = []
    for process in psutil.Process().children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::") and not title.split()[0].endswith("Agent"):
            workers.append(process.pid)
    return workers


def _private_mb(pid: int) -> float:
    """A process's private resident memory (``RssAnon``) in MB; 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(status.split("RssAnon:")[1].split()[0]) / 1024
    except (OSError, IndexError):
        return 0.0


def _serve_in_process(root: Path, count: int, max_side: int) -> tuple[str, Any]:
    """Starts the sample web in a child process, with photographs 0..count-1 made beforehand."""
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    process = context.Process(target=_serve, args=(str(root), count, max_side, ready), daemon=True)
    process.start()
    url = ready.get(timeout=600)

    def stop() -> None:
        process.terminate()
        process.join()

    return url, stop


def _serve(root: str, count: int, max_side: int, ready: Any) -> None:
    import threading

    from tasks.fixtures.web import SampleWeb, photo_path

    web = SampleWeb(root, max_side=max_side)
    for index in range(count):
        web.photo(Path(photo_path(index)).name)
    ready.put(web.url)
    threading.Event().wait()
