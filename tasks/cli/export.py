"""``vip export``: a checkpoint's weights for timm or the official MAE code, with a model card beside them."""

from __future__ import annotations

import argparse
from typing import Any

from tasks.cli.options import add_command
from vip_core.config import ENCODER_WEIGHTS, EXPORT_FORMATS


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "export", handle_export, help="export a checkpoint's weights with a model card",
        description="Writes the weights of a vip checkpoint to FILE for use outside vip, and the model card beside "
        "it (FILE's stem + .md and .json): the architecture, the timm.create_model call that loads the file, and "
        "the checkpoint's privacy ledger (epsilon, delta, sigma, q, steps, accountant, adjacency) with what its "
        "guarantee covers. Formats: timm (the encoder's state dict, torch.save), safetensors (the same, FILE "
        "ending in .safetensors), mae (facebookresearch/mae's layout: {'model': the whole autoencoder}). Prints "
        "one JSON object: the files written and the timm call.",
    )
    parser.add_argument("--checkpoint", required=True, metavar="PATH",
                        help="a vip checkpoint: a file, or a folder holding checkpoint.pt (a stage's OUTPUT/checkpoint)")
    parser.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="the file's layout")
    parser.add_argument("--output", required=True, metavar="FILE", help="the weights file to write (must not exist)")
    parser.add_argument("--weights", choices=ENCODER_WEIGHTS, default="final",
                        help="the checkpoint's final weights, or their moving average (a stage trained with "
                        "ema_decay > 0); default: final")


def handle_export(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from vip_core.models.export import export_checkpoint

    written = export_checkpoint(args.checkpoint, args.format, args.output, args.weights)
    card = written.pop("card")
    print_json({**written, "epsilon": (card["privacy"] or {}).get("epsilon"),
                "timm": card["timm"]["call"] if card["timm"] else None})
    return 0
