"""``vip ingest``: a LAION-format url list to clean webdataset shards (img2dataset, filters, dedup)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tasks.cli.options import add_command, add_config_flags, add_output, add_preset, config_from

# Flag -> (field of the config, type, help); a flag left out keeps the preset's value.
INGEST_FLAGS = {
    "--image-size": ("data.ingest.image_size", int, "side of the square output images, in pixels"),
    "--processes": ("data.ingest.processes", int, "img2dataset download processes"),
    "--threads": ("data.ingest.threads", int, "download threads per process"),
    "--timeout": ("data.ingest.timeout_s", float, "seconds before a download is abandoned"),
    "--samples-per-shard": ("data.ingest.samples_per_shard", int, "url-list rows per shard"),
    "--min-side": ("data.ingest.min_side", int, "smallest allowed image side, in pixels"),
    "--distributor": ("data.ingest.distributor", str, "multiprocessing (this machine) or ray (the cluster of "
                      "RAY_ADDRESS, else a local Ray; --output then on storage every node shares)"),
    "--rows-per-partition": ("data.ingest.rows_per_partition", int, "images per deduplication partition"),
}


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "ingest", handle_ingest, help="download a LAION-format url list into clean webdataset shards",
        description="Downloads a url list (parquet, csv or jsonl with a URL column) with img2dataset, drops "
        "failed downloads, NSFW-tagged, small and extreme-aspect images and rows failing --condition, removes "
        "exact and perceptual duplicates (one global pass) and near duplicates of --eval-data, and writes web-*.tar "
        "shards, manifest.parquet and stats.json in --output. Honours X-Robots-Tag: noai. Resumes a killed run. "
        "--distributor ray runs it on the Ray cluster of RAY_ADDRESS (else a local Ray).",
    )
    parser.add_argument("--url-list", required=True, help="LAION-format url list (.parquet, .csv or .jsonl)")
    add_output(parser, "the clean shards, manifest.parquet and stats.json")
    parser.add_argument("--eval-data", "--eval-images", dest="eval_images", metavar="DIR",
                        help="the evaluation data (a folder or fsspec URL), as `vip shards --eval-data` and make's "
                        "EVAL_DATA take it: near duplicates of any image below it are removed")
    add_preset(parser)
    add_config_flags(parser, INGEST_FLAGS)
    parser.add_argument("--condition", action="append",
                        help="row filter such as \"similarity >= 0.28\" (repeatable)")


def ingest_config(args: argparse.Namespace) -> Any:
    """The config with the flags the user gave, ``--condition`` included."""
    return config_from(args, INGEST_FLAGS, {"data.ingest.conditions": args.condition} if args.condition else None)


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
