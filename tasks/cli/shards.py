"""``vip shards``: training shards from a folder or bucket of images (``--input``), or a folder of shards
checked before training on it (``--check``)."""

from __future__ import annotations

import argparse
from typing import Any

from tasks.cli.ingest import INGEST_FLAGS
from tasks.cli.options import add_command, add_config_flags, add_preset, config_from, count
from vip_core.config import DISTRIBUTORS

# The ingestion flags that apply to image files (the others set img2dataset's downloads).
INPUT_FLAGS = {**{flag: INGEST_FLAGS[flag] for flag in ("--image-size", "--min-side", "--rows-per-partition")},
               "--samples-per-shard": ("data.ingest.samples_per_shard", int, "input files per shard")}


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "shards", handle_shards, help="write training shards from your own images, or check shards",
        description="--input: reads every file below FOLDER_OR_URL (a folder at any depth, or an fsspec URL such "
        "as s3://bucket/photos), drops files that are not usable images (counted by reason), small and "
        "extreme-aspect images, exact and near duplicates (the first in path order is kept) and near duplicates of "
        "the images below --eval-data, and writes web-*.tar shards, manifest.parquet and stats.json in --output, "
        "as `vip ingest` does for a url list; prints stats.json's counts. Running it again resumes or returns the "
        "finished counts. --check: decodes every image of the shards in DIR as pre-training decodes them and prints "
        "one JSON object: shards, images, the damaged images (shard, member, error) and the shards that cannot be "
        "read; exit code 1 when anything is damaged or unreadable.",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--input", metavar="FOLDER_OR_URL", help="the images to make shards of (local or fsspec URL)")
    mode.add_argument("--check", metavar="DIR", help="the folder of shards to check (local or fsspec URL)")
    parser.add_argument("--output", metavar="DIR", help="--input: the folder for the shards, manifest.parquet and "
                        "stats.json (local or fsspec URL)")
    parser.add_argument("--eval-data", metavar="DIR", help="--input: the evaluation data (a folder or fsspec URL); "
                        "near duplicates of any image below it are removed")
    add_config_flags(parser, {flag: (field, kind, f"--input: {text}") for flag, (field, kind, text) in INPUT_FLAGS.items()})
    parser.add_argument("--img-size", type=count(1),
                        help="--check: the side images are decoded to (default: the preset's model)")
    add_preset(parser)
    parser.add_argument("--distributor", choices=DISTRIBUTORS, default=None,
                        help="in this process (multiprocessing, the default), or Ray tasks (RAY_ADDRESS, else a "
                        "local Ray; --input: --output then on storage every node shares)")


def handle_shards(args: argparse.Namespace) -> int:
    from tasks.cli import UsageError

    wrong = _flags_of_the_other_mode(args)
    if wrong:
        raise UsageError(f"{wrong} does not go with --{'input' if args.input else 'check'}")
    if args.input is not None and not args.output:
        raise UsageError("--input needs --output")
    return _write(args) if args.input is not None else _check(args)


def _flags_of_the_other_mode(args: argparse.Namespace) -> str | None:
    """The first flag given that belongs to the mode not chosen."""
    others = ["--img-size"] if args.input is not None else ["--output", "--eval-data", *INPUT_FLAGS]
    return next((flag for flag in others if getattr(args, flag.removeprefix("--").replace("-", "_")) is not None), None)


def _write(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from tasks.stages.ingest import run_ingest_images

    config = config_from(args, INPUT_FLAGS, {"data.ingest.distributor": args.distributor} if args.distributor else None)
    print_json(run_ingest_images(config, args.input, args.output, eval_images=args.eval_data))
    return 0


def _check(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from tasks.stages.check import check_shards

    img_size = args.img_size or config_from(args).model.img_size
    report = check_shards(args.check, img_size, args.distributor or "multiprocessing")
    print_json(report)
    return 0 if report["ok"] else 1
