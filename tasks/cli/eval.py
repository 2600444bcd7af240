"""``vip eval``: one downstream job on a checkpoint's encoder and a random-init baseline;
``vip eval-data``: the small offline evaluation sets (digits, COCO-format shapes, ADE20K-format shapes)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from tasks.cli.options import (
    add_command, add_config_flags, add_data, add_mlflow_parent, add_output, add_preset, config_from, count,
)
from vip_core.config import EVAL_TASKS

EVAL_FLAGS = {
    "--device": ("evaluation.device", str, "auto (CUDA when there is a device), cpu or cuda"),
    "--workers": ("evaluation.num_workers", int, "Ray Train workers of a job that trains (0: this process)"),
    "--cpus-per-worker": ("evaluation.cpus_per_worker", float, "CPUs per Ray worker (fractions allowed)"),
    "--loader-workers": ("evaluation.loader_workers", int, "image-decoding processes"),
    "--precision": ("evaluation.precision", str, "fp32, or bf16 autocast of the forwards"),
}


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "eval", handle_eval, help="run one downstream evaluation job (with its random-init baseline)",
        description="Runs one job on the checkpoint's encoder and on a randomly initialised encoder of the same "
        "size, and writes metrics.json with both. Data layouts: ImageFolder (train/, val/) for linprobe, "
        "finetune and fewshot; COCO (annotations/instances_{train,val}2017.json, {train,val}2017/) for coco; "
        "ADE20K (images/, annotations/ with training/, validation/) for ade20k. Evaluation data is public: "
        "the pre-training privacy guarantee does not cover it.",
    )
    parser.add_argument("--task", required=True, choices=EVAL_TASKS)
    parser.add_argument("--checkpoint", required=True, help="checkpoint file or run folder (checkpoint.pt)")
    add_data(parser, "the task's dataset")
    add_output(parser, "metrics.json")
    add_preset(parser)
    parser.add_argument("--dp-finetune", metavar="NAME",
                        help="finetune with DP at a named setting (imagenet: the paper's ε 8, δ 8e-7)")
    add_config_flags(parser, EVAL_FLAGS)
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=None,
                        help="also run the job on a random-init encoder (default: the preset's)")
    add_mlflow_parent(parser)

    data_parser = add_command(
        subparsers, "eval-data", handle_eval_data, help="make the small offline evaluation sets",
        description="Writes classification/ (scikit-learn digits, ImageFolder), coco/ (COCO-format shapes with "
        "boxes and masks) and ade20k/ (ADE20K-format shapes) below --output, at the preset's image size; a set "
        "already there is kept.",
    )
    add_output(data_parser, "the three sets")
    add_preset(data_parser)
    data_parser.add_argument("--scenes", type=count(1), default=64, help="training scenes of coco/ and ade20k/")


def evaluation_config(args: argparse.Namespace) -> Any:
    """The config with the flags' fields, and the named DP fine-tuning setting when ``--dp-finetune`` is given."""
    from tasks.cli import UsageError
    from vip_core.config import DP_FINETUNE_PRESETS

    overrides: dict[str, Any] = {}
    if args.baseline is not None:
        overrides["evaluation.random_init_baseline"] = args.baseline
    if args.dp_finetune is not None:
        if args.task != "finetune":
            raise UsageError(f"--dp-finetune applies to --task finetune, not {args.task}")
        if args.dp_finetune not in DP_FINETUNE_PRESETS:
            raise UsageError(f"--dp-finetune: unknown setting {args.dp_finetune!r} "
                             f"(known: {', '.join(DP_FINETUNE_PRESETS)})")
        overrides["evaluation.finetune_privacy"] = DP_FINETUNE_PRESETS[args.dp_finetune]().model_dump()
    return config_from(args, EVAL_FLAGS, overrides)


def handle_eval(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from tasks.stages.eval import run_evaluation

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = evaluation_config(args)
    print_json(run_evaluation(config, args.task, args.checkpoint, args.data, args.output,
                              mlflow_run_id=args.mlflow_parent))
    return 0


def handle_eval_data(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from tasks.fixtures.eval_sets import make_eval_sets

    print_json(make_eval_sets(args.output, config_from(args).model.img_size, args.scenes))
    return 0
