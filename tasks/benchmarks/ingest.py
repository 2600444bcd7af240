"""``vip bench ingest``: images/s of the whole ingestion stage against img2dataset alone, in the same run.

Both sides fetch the same url list of sample photographs from the same server on 127.0.0.1, which runs
in its own process with every photograph made beforehand. img2dataset alone downloads, centre-crops
and resizes into webdataset shards with the stage's image size, processes, threads and shard size, and
without EXIF extraction, as the stage runs it. The stage (``run_ingest``) is that download, without
img2dataset's re-encoding, plus decoding, filtering, hashing, deduplication, decontamination against
``--eval-images`` evaluation images, resizing and writing the clean shards, the manifest and the stats.
The sides alternate, ``--repeats`` times each; the best pass of each counts. Rates are input rows per
second of wall time from start to finish, process start-up included.
"""

from __future__ import annotations

import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_OVERHEAD = 0.20


def bench_ingest(*, num_images: int, max_side: int, image_size: int, processes: int, threads: int,
                 samples_per_shard: int, eval_images: int, repeats: int) -> dict[str, Any]:
    """Best-of-``repeats`` images/s of img2dataset alone and of the stage on one url list; the overhead.

    Args:
        num_images: rows in the url list.
        max_side: longer side of the served photographs.
        image_size, processes, threads, samples_per_shard: the stage's settings (``data.ingest``).
        eval_images: evaluation images the stage decontaminates against.
        repeats: passes of each side; the best counts.
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
    stage_rate = num_images / min(stage)
    overhead = baseline_rate / stage_rate - 1
    return {
        "benchmark": "ingest", "num_images": num_images, "served_max_side": max_side,
        "image_size": image_size, "processes": processes, "threads": threads,
        "samples_per_shard": samples_per_shard, "eval_images": eval_images, "repeats": repeats,
        "img2dataset_seconds": round(min(baseline), 2), "stage_seconds": round(min(stage), 2),
        "img2dataset_images_per_s": round(baseline_rate, 2), "stage_images_per_s": round(stage_rate, 2),
        "overhead": round(overhead, 4), "target_overhead": TARGET_OVERHEAD, "meets_target": overhead < TARGET_OVERHEAD,
    }


def _time_img2dataset(config: Any, url_list: Path, folder: Path) -> float:
    from tasks.stages.ingest import finish_process, img2dataset_arguments, start_img2dataset, write_img2dataset_input
    from vip_core.data.urllist import read_url_list

    started = time.perf_counter()
    url_input = write_img2dataset_input(folder / "urls.parquet", read_url_list(url_list).urls())
    arguments = img2dataset_arguments(config.data.ingest, url_input, folder / "raw", reencode=True)
    process = start_img2dataset(arguments, folder / "img2dataset.log")
    process.wait()
    seconds = time.perf_counter() - started
    finish_process(process)
    if process.returncode != 0:
        raise RuntimeError(f"img2dataset failed (exit code {process.returncode}); see {folder / 'img2dataset.log'}")
    return seconds


def _time_stage(config: Any, url_list: Path, folder: Path, eval_folder: Path) -> float:
    from tasks.stages.ingest import run_ingest

    started = time.perf_counter()
    stats = run_ingest(config, url_list, folder, eval_images=eval_folder)
    seconds = time.perf_counter() - started
    if stats["kept"] + stats["duplicates"] + stats["decontaminated"] == 0:
        raise RuntimeError(f"the stage kept nothing: {stats}")
    return seconds


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
