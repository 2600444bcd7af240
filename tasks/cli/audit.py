"""``vip audit``: a lower bound on ε from one training run with canaries (Steinke, Nasr and Jagielski, 2023).

    vip audit --preset tiny --canaries 1000 --delta 1e-5 --json
    {"epsilon_claimed": 8.0, "epsilon_lower_bound": 0.9, "canaries": 1000, "correct_guesses": 281, ...}
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "audit", help="empirical lower bound on epsilon with white-box gradient canaries",
        description="Trains the preset's model with its private-stage settings (batch size, steps, clipping, "
        "sigma calibrated to the target epsilon, delta) plus canaries, half of them included at random, and "
        "reports the lower bound on epsilon that the canaries' scores prove at 95%% confidence beside the "
        "accountant's epsilon. The output is one JSON object.",
    )
    parser.add_argument("--preset", default="tiny", help="configuration preset (default: tiny)")
    parser.add_argument("--canaries", type=_positive_int, default=1000, help="number of canaries (default 1000)")
    parser.add_argument("--target-epsilon", type=float, help="override privacy.target_epsilon")
    parser.add_argument("--delta", type=float, help="override privacy.delta (default: the preset's, else 1/(2N))")
    parser.add_argument("--no-privacy", action="store_true", help="audit the non-private run (no noise, no clipping)")
    parser.add_argument("--output", help="folder for audit.json (default: $VIP_HOME/runs/audit/<preset>-<hash>)")
    parser.add_argument("--mlflow-run", metavar="RUN_ID", help="log into this MLflow run (default: a new run)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object (the only format)")
    parser.set_defaults(handler=handle_audit)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2, got {text}")
    return value


def handle_audit(args: argparse.Namespace) -> int:
    from tasks.audit import run_audit
    from tasks.cli import print_json
    from vip_core.config import get_preset, with_overrides
    from tasks.runtime.environment import state_paths

    overrides: dict[str, Any] = {}
    if args.target_epsilon is not None:
        overrides["privacy.target_epsilon"] = args.target_epsilon
    if args.delta is not None:
        overrides["privacy.delta"] = args.delta
    if args.no_privacy:
        overrides["privacy.enabled"] = False
    config = with_overrides(get_preset(args.preset), overrides)
    output = args.output or str(state_paths()["runs"] / "audit" / _folder_name(args.preset, config, args.canaries))
    result = run_audit(config, args.canaries, output, mlflow_run_id=args.mlflow_run)
    print_json(result)
    return 0


def _folder_name(preset: str, config: Any, canaries: int) -> str:
    """``<preset>-<hash of the configuration and canaries>``: one folder per distinct audit."""
    import hashlib
    import json

    payload = json.dumps([config.model_dump(mode="json"), canaries], sort_keys=True).encode()
    return f"{preset}-{hashlib.sha256(payload).hexdigest()[:10]}"
