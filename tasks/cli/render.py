"""``vip render``: synthetic images from Shadertoy programs (built-in generator or a folder) into shards."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from tasks.cli.options import add_command, add_config_flags, add_output, add_preset, add_yes, config_from
from tasks.runtime.sizing import RunSize, size_run

# Flag -> (field of the config, type, help); a flag left out keeps the preset's value.
RENDER_FLAGS = {
    "--num-images": ("data.render.num_images", int, "number of images"),
    "--size": ("data.render.size", int, "image side in pixels"),
    "--seed": ("data.render.seed", int, "seed of the program and time draws"),
    "--mixup": ("data.render.mixup", int, "K > 1: each image is a convex mix of K images"),
    "--workers": ("data.render.workers", int, "worker processes, one GL context each"),
    "--samples-per-shard": ("data.render.samples_per_shard", int, "images per shard"),
    "--images-per-program": ("data.render.images_per_program", int, "images rendered per compiled program draw"),
    "--num-programs": ("data.render.num_programs", int, "size of the generator's program pool"),
}


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "render", handle_render, help="render synthetic images from shader programs into webdataset shards",
        description="Renders Shadertoy-style programs headless (moderngl, EGL) into webdataset shards with a "
        "manifest. Defaults come from the preset's data.render; flags override them. Resumes a killed run.",
    )
    add_output(parser, "the shards, manifest.jsonl and stats.json")
    add_preset(parser)
    add_config_flags(parser, RENDER_FLAGS)
    parser.add_argument("--shaders", help="folder of Shadertoy programs: .frag/.glsl GLSL or .json/.fragment "
                        "(Shaders21k) JSON (default: the built-in generator)")
    parser.add_argument("--contact-sheet", metavar="PNG", help="also tile the first 64 images into this PNG")
    add_yes(parser)
    parser.set_defaults(sizer=size_render)


def size_render(args: argparse.Namespace) -> RunSize:
    return size_run(config_from(args, RENDER_FLAGS), ("render",), ingest_rows=None)


def handle_render(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from tasks.stages.render import run_render, write_contact_sheet

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # progress on stderr
    result = run_render(config_from(args, RENDER_FLAGS), args.output, shaders=args.shaders)
    if args.contact_sheet:
        result.update(write_contact_sheet(args.output, args.contact_sheet))
    print_json(result)
    return 0
