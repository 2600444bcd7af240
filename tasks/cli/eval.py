"""``vip evaluate``: one downstream job on a checkpoint's encoder and a random-init baseline;
``vip eval-data``: the small offline evaluation sets (digits, COCO-format shapes, ADE20K-format shapes)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

TASKS = ("linprobe", "finetune", "fewshot", "coco", "ade20k")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "evaluate", help="run one downstream evaluation job (with its random-init baseline)",
        description="Runs one job on the checkpoint's encoder and on a randomly initialised encoder of the same "
        "size, and writes metrics.json with both. Data layouts: ImageFolder (train/, val/) for linprobe, "
        "finetune and fewshot; COCO (annotations/instances_{train,val}2017.json, {train,val}2017/) for coco; "
        "ADE20K (images/, annotations/ with training/, validation/) for ade20k. Evaluation data is public: "
        "the pre-training privacy guarantee does not cover it.",
    )
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument("--checkpoint", required=True, help="checkpoint file or run folder (checkpoint.pt)")
    parser.add_argument("--data", required=True, help="the task's dataset folder")
    parser.add_argument("--preset", default="tiny", help="configuration preset (default: tiny)")
    parser.add_argument("--output", help="folder for metrics.json (default: $VIP_HOME/runs/eval/<task>)")
    parser.add_argument("--dp-finetune", metavar="NAME",
                        help="finetune with DP at a named setting (imagenet: the paper's ε 8, δ 8e-7)")
    parser.add_argument("--mlflow-parent", metavar="RUN_ID", help="log a child run under this MLflow run")
    parser.set_defaults(handler=handle_evaluate)

    data_parser = subparsers.add_parser(
        "eval-data", help="make the small offline evaluation sets",
        description="Writes classification/ (scikit-learn digits, ImageFolder), coco/ (COCO-format shapes with "
        "boxes and masks) and ade20k/ (ADE20K-format shapes) below --root, at the preset's image size.",
    )
    data_parser.add_argument("--root", required=True, help="output folder")
    data_parser.add_argument("--preset", default="tiny", help="configuration preset (default: tiny)")
    data_parser.add_argument("--scenes", type=int, default=64, help="training scenes of coco/ and ade20k/")
    data_parser.set_defaults(handler=handle_eval_data)


def evaluation_config(args: argparse.Namespace) -> Any:
    """The preset, with the named DP fine-tuning setting when ``--dp-finetune`` is given."""
    from tasks.cli import UsageError
    from vip_core.config import DP_FINETUNE_PRESETS, get_preset

    config = get_preset(args.preset)
    if args.dp_finetune is None:
        return config
    if args.task != "finetune":
        raise UsageError(f"--dp-finetune applies to --task finetune, not {args.task}")
    if args.dp_finetune not in DP_FINETUNE_PRESETS:
        raise UsageError(f"--dp-finetune: unknown setting {args.dp_finetune!r} (known: {', '.join(DP_FINETUNE_PRESETS)})")
    evaluation = config.evaluation.model_copy(update={"finetune_privacy": DP_FINETUNE_PRESETS[args.dp_finetune]()})
    return config.model_copy(update={"evaluation": evaluation})


def handle_evaluate(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from tasks.stages.eval import run_evaluation
    from tasks.runtime.environment import state_paths

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = evaluation_config(args)
    output = args.output or str(state_paths()["runs"] / "eval" / args.task)
    print_json(run_evaluation(config, args.task, args.checkpoint, args.data, output, mlflow_run_id=args.mlflow_parent))
    return 0


def handle_eval_data(args: argparse.Namespace) -> int:
    from tasks.cli import UsageError, print_json
    from tasks.fixtures.eval_sets import make_ade20k_shapes, make_coco_shapes, make_digits_imagefolder
    from vip_core.config import get_preset

    if args.scenes < 1:
        raise UsageError(f"--scenes must be >= 1, got {args.scenes}")
    img_size = get_preset(args.preset).model.img_size
    root = Path(args.root)
    print_json({
        "classification": make_digits_imagefolder(root / "classification", img_size),
        "coco": make_coco_shapes(root / "coco", img_size, args.scenes),
        "ade20k": make_ade20k_shapes(root / "ade20k", img_size, args.scenes),
    })
    return 0
