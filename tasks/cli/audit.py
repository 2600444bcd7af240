"""``vip audit``: a lower bound on ε from one training run with canaries (Steinke, Nasr and Jagielski, 2023).

    vip audit --preset tiny --canaries 1000 --output DIR --json
    {"epsilon_claimed": 8.0, "epsilon_lower_bound": 0.9, "canaries": 1000, "correct_guesses": 281, ...}
"""

from __future__ import annotations

import argparse
from typing import Any

from tasks.cli.options import (
    add_command, add_json, add_mlflow_parent, add_output, add_preset, config_from, count, number,
)


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "audit", handle_audit, help="empirical lower bound on epsilon with white-box gradient canaries",
        description="Trains the preset's model with its private-stage settings (batch size, steps, clipping, "
        "sigma calibrated to the target epsilon, delta) plus canaries, half of them included at random, and "
        "reports the lower bound on epsilon that the canaries' scores prove at 95%% confidence beside the "
        "accountant's epsilon. The output is one JSON object.",
    )
    add_preset(parser)
    parser.add_argument("--canaries", type=count(2), default=1000, help="number of canaries (default 1000)")
    parser.add_argument("--target-epsilon", type=number("> 0", lambda v: v > 0),
                        help="override privacy.target_epsilon")
    parser.add_argument("--delta", type=number("in (0, 1)", lambda v: 0 < v < 1),
                        help="delta of the claim (default: the preset's privacy.delta, else 0.01/canaries, small "
                             "enough for the bound to have power; the output says which was used)")
    parser.add_argument("--no-privacy", action="store_true", help="audit the non-private run (no noise, no clipping)")
    add_output(parser, "audit.json")
    add_mlflow_parent(parser)
    add_json(parser)


def audit_config(args: argparse.Namespace) -> Any:
    """The preset and config file with the privacy overrides the user gave."""
    overrides: dict[str, Any] = {"privacy.target_epsilon": args.target_epsilon, "privacy.delta": args.delta,
                                 "privacy.enabled": False if args.no_privacy else None}
    return config_from(args, overrides={key: value for key, value in overrides.items() if value is not None})


def handle_audit(args: argparse.Namespace) -> int:
    from tasks.stages.audit import run_audit
    from tasks.cli import print_json
    from tasks.runtime import tracking

    config = audit_config(args)
    with tracking.optional_stage_run(args.mlflow_parent, "audit", config) as run_id:
        result = run_audit(config, args.canaries, args.output, mlflow_run_id=run_id)
    print_json(result)
    return 0
