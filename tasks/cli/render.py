"""``vip render``: synthetic images from Shadertoy programs (built-in generator or a folder) into shards."""

from __future__ import annotations

import argparse
import logging
from typing import Any

# Command-line flag -> field of config.data.render; a flag left out keeps the preset's value.
RENDER_FLAGS = {
    "num_images": "num_images",
    "size": "size",
    "seed": "seed",
    "mixup": "mixup",
    "workers": "workers",
    "samples_per_shard": "samples_per_shard",
    "images_per_program": "images_per_program",
    "num_programs": "num_programs",
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "render", help="render synthetic images from shader programs into webdataset shards",
        description="Renders Shadertoy-style programs headless (moderngl, EGL) into webdataset shards with a "
        "manifest. Defaults come from the preset's data.render; flags override them. Resumes a killed run.",
    )
    parser.add_argument("--out", required=True, help="output folder for shards, manifest.jsonl and stats.json")
    parser.add_argument("--preset", default="tiny", help="configuration preset (default: tiny)")
    parser.add_argument("--num-images", type=int, help="number of images")
    parser.add_argument("--size", type=int, help="image side in pixels")
    parser.add_argument("--shaders", help="folder of Shadertoy programs: .frag/.glsl GLSL or .json/.fragment (Shaders21k) JSON "
                        "(default: the built-in generator)")
    parser.add_argument("--seed", type=int, help="seed of the program and time draws")
    parser.add_argument("--mixup", type=int, help="K > 1: each image is a convex mix of K images")
    parser.add_argument("--workers", type=int, help="worker processes, one GL context each")
    parser.add_argument("--samples-per-shard", type=int, help="images per shard")
    parser.add_argument("--images-per-program", type=int, help="images rendered per compiled program draw")
    parser.add_argument("--num-programs", type=int, help="size of the generator's program pool")
    parser.add_argument("--contact-sheet", metavar="PNG", help="also tile the first 64 images into this PNG")
    parser.set_defaults(handler=handle_render)


def render_config(args: argparse.Namespace) -> Any:
    """The preset with the flags the user gave applied to ``data.render``."""
    from vip_core.config import get_preset, with_overrides

    overrides = {
        f"data.render.{field}": getattr(args, flag) for flag, field in RENDER_FLAGS.items()
        if getattr(args, flag) is not None
    }
    return with_overrides(get_preset(args.preset), overrides)


def handle_render(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from tasks.stages.render import run_render, write_contact_sheet

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # progress on stderr
    result = run_render(render_config(args), args.out, shaders=args.shaders)
    if args.contact_sheet:
        result.update(write_contact_sheet(args.out, args.contact_sheet))
    print_json(result)
    return 0
