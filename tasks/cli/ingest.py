"""``vip ingest``: a LAION-format url list to clean webdataset shards (img2dataset, filters, dedup)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

# Command-line flag -> field of config.data.ingest; a flag left out keeps the preset's value.
INGEST_FLAGS = {
    "image_size": "image_size",
    "processes": "processes",
    "threads": "threads",
    "timeout": "timeout_s",
    "samples_per_shard": "samples_per_shard",
    "min_side": "min_side",
    "condition": "conditions",
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "ingest", help="download a LAION-format url list into clean webdataset shards",
        description="Downloads a url list (parquet, csv or jsonl with a URL column) with img2dataset, drops "
        "failed downloads, NSFW-tagged, small and extreme-aspect images and rows failing --condition, removes "
        "exact and perceptual duplicates and near duplicates of --eval-images, and writes web-*.tar shards, "
        "manifest.parquet and stats.json in --output. Honours X-Robots-Tag: noai. Resumes a killed run.",
    )
    parser.add_argument("--url-list", required=True, help="LAION-format url list (.parquet, .csv or .jsonl)")
    parser.add_argument("--output", required=True, help="output folder")
    parser.add_argument("--eval-images", help="folder of downstream evaluation images to decontaminate against")
    parser.add_argument("--preset", default="tiny", help="configuration preset (default: tiny)")
    parser.add_argument("--image-size", type=int, help="side of the square output images, in pixels")
    parser.add_argument("--processes", type=int, help="img2dataset download processes")
    parser.add_argument("--threads", type=int, help="download threads per process")
    parser.add_argument("--timeout", type=float, help="seconds before a download is abandoned")
    parser.add_argument("--samples-per-shard", type=int, help="url-list rows per shard")
    parser.add_argument("--min-side", type=int, help="smallest allowed image side, in pixels")
    parser.add_argument(
        "--condition", action="append", help="row filter such as \"similarity >= 0.28\" (repeatable)"
    )
    parser.set_defaults(handler=handle_ingest)


def ingest_config(args: argparse.Namespace) -> Any:
    """The preset with the flags the user gave applied to ``data.ingest``."""
    from vip_core.config import get_preset, with_overrides

    overrides = {
        f"data.ingest.{field}": getattr(args, flag) for flag, field in INGEST_FLAGS.items()
        if getattr(args, flag) is not None
    }
    return with_overrides(get_preset(args.preset), overrides)


def handle_ingest(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from tasks.stages.ingest import IngestError, run_ingest

    try:
        stats = run_ingest(ingest_config(args), args.url_list, args.output, eval_images=args.eval_images)
    except IngestError as error:
        print(f"vip ingest: error: {error}", file=sys.stderr)
        return 1
    print_json(stats)
    return 0
