"""``vip pretrain``: MAE pre-training on Ray Train, synthetic (DP off) or private (DP-AdamW).

Ray is started locally unless ``RAY_ADDRESS`` names a cluster. The command prints one JSON object: the
final checkpoint, steps, ε (private stage), images/s and the workers' peak resident memory.
"""

from __future__ import annotations

import argparse
from typing import Any

from tasks.cli.options import (
    add_command, add_config_flags, add_data, add_mlflow_parent, add_output, add_preset, add_yes, config_from,
)
from tasks.runtime.names import PRETRAIN_STAGES
from tasks.runtime.sizing import RunSize, size_run
from vip_core.config import VipConfig

# Flag -> (field of the stage's training config, type, help); ``{stage}`` is synthetic or private.
STAGE_FLAGS = {
    "--workers": ("{stage}.num_workers", int, "Ray Train workers"),
    "--cpus-per-worker": ("{stage}.cpus_per_worker", float, "CPUs per worker (fractions allowed)"),
    "--steps": ("{stage}.steps", int, "logical steps"),
    "--batch-size": ("{stage}.batch_size", int, "expected logical batch size B"),
    "--physical-batch-size": ("{stage}.physical_batch_size", int, "microbatch size, bounds memory"),
    "--checkpoint-every": ("{stage}.checkpoint_every", int, "steps between checkpoints"),
}


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "pretrain", handle_pretrain,
        help="pre-train the MAE on Ray Train (synthetic images, or DP on web images)",
        description="Pre-trains the MAE for one stage on Ray Train with N workers on a local Ray (or the cluster "
        "in RAY_ADDRESS). The private stage samples with Poisson sampling, clips per sample, adds noise once "
        "per step and stops before epsilon would pass its target. Prints one JSON object.",
    )
    parser.add_argument("--stage", required=True, choices=sorted(PRETRAIN_STAGES), help="synthetic (no DP) or private (DP)")
    add_preset(parser)
    add_data(parser, "webdataset tar or parquet shards to train on")
    add_output(parser, "the stage: Ray Train's checkpoints, checkpoint/ and result.json")
    parser.add_argument("--init-checkpoint", help="warm-start weights (the private stage: the synthetic stage's "
                        "checkpoint/ folder)")
    parser.add_argument("--resume", action="store_true", help="continue the run left in --output")
    add_config_flags(parser, STAGE_FLAGS)
    add_mlflow_parent(parser)
    add_yes(parser)
    parser.set_defaults(sizer=size_pretrain)


def stage_config(args: argparse.Namespace) -> VipConfig:
    """The command's config, its stage flags applied to ``args.stage``'s training config."""
    flags = {flag: (field.format(stage=args.stage), kind, text) for flag, (field, kind, text) in STAGE_FLAGS.items()}
    return config_from(args, flags)


def size_pretrain(args: argparse.Namespace) -> RunSize:
    return size_run(stage_config(args), (PRETRAIN_STAGES[args.stage],), ingest_rows=None)


def handle_pretrain(args: argparse.Namespace) -> int:
    config = stage_config(args)  # before the imports of torch and Ray: a wrong setting fails at once
    from tasks.cli import print_json
    from tasks.stages.pretrain import run_pretrain
    from tasks.runtime import tracking

    with tracking.optional_stage_run(args.mlflow_parent, PRETRAIN_STAGES[args.stage], config) as run_id:
        result = run_pretrain(config, args.stage, args.data, args.output, init_checkpoint=args.init_checkpoint,
                              resume=args.resume, mlflow_run_id=run_id)
    print_json(result)
    return 0
