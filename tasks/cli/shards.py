"""``vip shards --check DIR``: every image of a folder of shards decoded as training decodes it, before a long run."""

from __future__ import annotations

import argparse
from typing import Any

from tasks.cli.options import add_command, add_preset, config_from, count
from vip_core.config import DISTRIBUTORS


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "shards", handle_shards, help="check a folder of shards before training on it",
        description="Decodes every image of the shards in DIR (a folder or fsspec URL of webdataset tars or parquet "
        "files) as pre-training decodes them, and prints one JSON object: shards, images, the damaged images "
        "(shard, member, error) and the shards that cannot be read. Training skips a damaged image (it contributes "
        "nothing) and stops at an unreadable shard. Exit code 1 when anything is damaged or unreadable.",
    )
    parser.add_argument("--check", required=True, metavar="DIR", help="the folder of shards (local or fsspec URL)")
    parser.add_argument("--img-size", type=count(1), help="the side images are decoded to (default: the preset's model)")
    add_preset(parser)
    parser.add_argument("--distributor", choices=DISTRIBUTORS, default="multiprocessing",
                        help="check in this process, or one Ray task a shard (RAY_ADDRESS, else a local Ray)")


def handle_shards(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from tasks.stages.check import check_shards

    img_size = args.img_size or config_from(args).model.img_size
    report = check_shards(args.check, img_size, args.distributor)
    print_json(report)
    return 0 if report["ok"] else 1
