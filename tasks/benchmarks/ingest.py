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

import argparse
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_OVERHEAD = 0.20


def register(bench_subparsers: Any) -> None:
    parser = bench_subparsers.add_parser(
        "ingest", help="images/s of the ingestion stage (filters, dedup, decontamination) against img2dataset alone",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--num-images", type=int, default=1000, help="rows in the url list (default: 1000)")
    parser.add_argument("--max-side", type=int, default=256, help="longer side of the served photographs (default: 256)")
    parser.add_argument("--image-size", type=int, default=64, help="output image side (default: 64)")
    parser.add_argument("--processes", type=int, default=1, help="download processes (default: 1)")
    parser.add_argument("--threads", type=int, default=16, help="threads per process (default: 16)")
    parser.add_argument("--samples-per-shard", type=int, default=250, help="rows per shard (default: 250)")
    parser.add_argument("--eval-images", type=int, default=200, help="evaluation images to decontaminate against")
    parser.add_argument("--repeats", type=int, default=1, help="passes of each side; the best counts (default: 1)")
    parser.set_defaults(handler=handle_bench_ingest)


def handle_bench_ingest(args: argparse.Namespace) -> int:
    from tasks.cli import UsageError, print_json

    sizes = (args.num_images, args.max_side, args.image_size, args.processes, args.threads, args.samples_per_shard)
    if min(sizes) <= 0 or args.repeats <= 0 or args.eval_images < 0:
        raise UsageError("--num-images, --max-side, --image-size, --processes, --threads, --samples-per-shard and "
                         "--repeats must be positive")
    result = bench_ingest(args)
    if args.json:
        print_json(result)
    else:
        print(
            f"img2dataset alone {result['img2dataset_images_per_s']:8.1f} img/s   "
            f"ingest stage {result['stage_images_per_s']:8.1f} img/s   overhead {100 * result['overhead']:.1f}%"
        )
        print(f"target overhead < {100 * TARGET_OVERHEAD:.0f}%: {result['meets_target']}")
    return 0


def bench_ingest(args: argparse.Namespace) -> dict[str, Any]:
    """Best-of-``repeats`` images/s of img2dataset alone and of the stage on one url list; the overhead."""
    from tasks.fixtures.web import laion_row, photo_path, sample_photo, write_url_list
    from vip_core.config import get_preset, with_overrides

    settings = {
        "image_size": args.image_size, "processes": args.processes, "threads": args.threads,
        "samples_per_shard": args.samples_per_shard, "min_side": 16, "timeout_s": 30.0,
    }
    config = with_overrides(get_preset("tiny"), {f"data.ingest.{key}": value for key, value in settings.items()})
    with tempfile.TemporaryDirectory(prefix="vip-bench-ingest-") as folder:
        work = Path(folder)
        url, stop = _serve_in_process(work / "web", args.num_images, args.max_side)
        try:
            url_list = write_url_list(
                work / "laion.parquet", [laion_row(url + photo_path(i), f"photo {i}") for i in range(args.num_images)]
            )
            eval_folder = work / "eval"
            eval_folder.mkdir()
            for index in range(args.eval_images):
                sample_photo(1_000_000 + index, 128).save(eval_folder / f"{index}.png")
            baseline, stage = [], []
            for attempt in range(args.repeats):
                baseline.append(_time_img2dataset(config, url_list, work / f"alone-{attempt}"))
                stage.append(_time_stage(config, url_list, work / f"stage-{attempt}", eval_folder))
        finally:
            stop()
    baseline_rate = args.num_images / min(baseline)
    stage_rate = args.num_images / min(stage)
    overhead = baseline_rate / stage_rate - 1
    return {
        "benchmark": "ingest", "num_images": args.num_images, "served_max_side": args.max_side,
        "image_size": args.image_size, "processes": args.processes, "threads": args.threads,
        "samples_per_shard": args.samples_per_shard, "eval_images": args.eval_images, "repeats": args.repeats,
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
