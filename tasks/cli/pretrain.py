"""``vip pretrain``: MAE pre-training on Ray Train, synthetic (DP off) or private (DP-AdamW).

Ray is started locally unless ``RAY_ADDRESS`` names a cluster. The command prints one JSON object: the
final checkpoint, steps, ε (private stage), images/s and the workers' peak resident memory.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

STAGE_DATA = {"synthetic": "synthetic", "private": "web"}

# Command-line flag -> field of the stage's TrainingConfig; a flag left out keeps the preset's value.
STAGE_FLAGS = {
    "workers": "num_workers",
    "steps": "steps",
    "batch_size": "batch_size",
    "physical_batch_size": "physical_batch_size",
    "cpus_per_worker": "cpus_per_worker",
    "checkpoint_every": "checkpoint_every",
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pretrain", help="pre-train the MAE on Ray Train (synthetic images, or DP on web images)",
        description="Pre-trains the MAE for one stage on Ray Train with N workers on a local Ray (or the cluster "
        "in RAY_ADDRESS). The private stage samples with Poisson sampling, clips per sample, adds noise once "
        "per step and stops before epsilon would pass its target. Prints one JSON object.",
    )
    parser.add_argument("--stage", required=True, choices=sorted(STAGE_DATA), help="synthetic (no DP) or private (DP)")
    parser.add_argument("--preset", default="tiny", help="configuration preset (default: tiny)")
    parser.add_argument(
        "--data", help="folder of webdataset tar or parquet shards (default: $VIP_HOME/data/synthetic or /web)"
    )
    parser.add_argument("--output", help="the stage's folder (default: $VIP_HOME/runs/PRESET/pretrain-syn or -dp)")
    parser.add_argument(
        "--init-checkpoint",
        help="warm-start weights (private stage default: the synthetic stage's checkpoint when it exists)",
    )
    parser.add_argument("--resume", action="store_true", help="continue the run left in --output")
    parser.add_argument("--workers", type=int, help="Ray Train workers")
    parser.add_argument("--cpus-per-worker", type=float, help="CPUs per worker (fractions allowed)")
    parser.add_argument("--steps", type=int, help="logical steps")
    parser.add_argument("--batch-size", type=int, help="expected logical batch size B")
    parser.add_argument("--physical-batch-size", type=int, help="microbatch size, bounds memory")
    parser.add_argument("--checkpoint-every", type=int, help="steps between checkpoints")
    parser.add_argument("--mlflow-run-id", help="the MLflow run to log into (default: a new run)")
    parser.set_defaults(handler=handle_pretrain)


def pretrain_config(args: argparse.Namespace) -> Any:
    """The preset with the flags the user gave applied to the stage's training config."""
    from vip_core.config import get_preset, with_overrides

    overrides = {
        f"{args.stage}.{field}": getattr(args, flag) for flag, field in STAGE_FLAGS.items()
        if getattr(args, flag) is not None
    }
    return with_overrides(get_preset(args.preset), overrides)


def default_paths(args: argparse.Namespace) -> tuple[Path, Path, Path | None]:
    """``(data, output, init_checkpoint)`` with the defaults under ``$VIP_HOME`` filled in."""
    from tasks.pretrain import STAGES
    from tasks.runtime.environment import state_paths

    paths = state_paths()
    data = Path(args.data) if args.data else paths["data"] / STAGE_DATA[args.stage]
    output = Path(args.output) if args.output else paths["runs"] / args.preset / STAGES[args.stage]
    init = Path(args.init_checkpoint) if args.init_checkpoint else None
    if init is None and args.stage == "private":
        synthetic = paths["runs"] / args.preset / STAGES["synthetic"] / "checkpoint"
        init = synthetic if synthetic.is_dir() else None
    return data, output, init


def handle_pretrain(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from tasks.pretrain import run_pretrain

    config = pretrain_config(args)
    data, output, init = default_paths(args)
    result = run_pretrain(
        config, args.stage, data, output, init_checkpoint=init, resume=args.resume, mlflow_run_id=args.mlflow_run_id
    )
    print_json(result)
    return 0
