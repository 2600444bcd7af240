"""``vip privacy epsilon`` and ``vip privacy calibrate``: the accountant from the command line.

    vip privacy epsilon --noise-multiplier 0.48 --sample-rate 0.00042 --steps 6000 --delta 2.1e-9
    {"epsilon": 6.83, "accountant": "pld"}
    vip privacy calibrate --target-epsilon 8 --sample-rate 0.00042 --steps 6000 --delta 2.1e-9
    {"noise_multiplier": 0.4567, "epsilon": 7.99, "accountant": "pld"}
    vip privacy epsilon --noise-multiplier 0.48 --sample-rate 0.00042 --steps 6000 --delta 2.1e-9 --accountant rdp
    {"epsilon": 7.99, "accountant": "rdp", "epsilon_pld": 6.83}
"""

from __future__ import annotations

import argparse
from typing import Any

from tasks.cli.options import add_command, count, number
from vip_core.privacy.accounting import ACCOUNTANTS, DEFAULT_ACCOUNTANT  # light: the accountants load lazily


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("privacy", help="privacy accounting: epsilon for sigma, sigma for epsilon")
    actions = parser.add_subparsers(dest="action", required=True)

    epsilon = add_command(actions, "epsilon", _epsilon, help="epsilon spent by DP-SGD with the given sigma")
    epsilon.add_argument("--noise-multiplier", required=True, type=number("> 0", lambda v: v > 0),
                         help="sigma: noise std over the clipping norm")
    _add_common(epsilon, min_steps=0)

    calibrate = add_command(actions, "calibrate", _calibrate, help="smallest sigma whose epsilon is at most the target")
    calibrate.add_argument("--target-epsilon", required=True, type=number("> 0", lambda v: v > 0))
    _add_common(calibrate, min_steps=1)


def _add_common(parser: argparse.ArgumentParser, min_steps: int) -> None:
    parser.add_argument("--sample-rate", required=True, type=number("in (0, 1]", lambda v: 0 < v <= 1),
                        help="q: Poisson sampling probability (expected batch size / dataset size)")
    parser.add_argument("--steps", required=True, type=count(min_steps), help="number of logical steps")
    parser.add_argument("--delta", required=True, type=number("in (0, 1)", lambda v: 0 < v < 1))
    parser.add_argument("--accountant", choices=ACCOUNTANTS, default=DEFAULT_ACCOUNTANT,
                        help=f"default {DEFAULT_ACCOUNTANT}")


def _epsilon(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from vip_core.privacy.accounting import compute_epsilon

    accounting = dict(sample_rate=args.sample_rate, steps=args.steps, delta=args.delta, accountant=args.accountant)
    epsilon = compute_epsilon(noise_multiplier=args.noise_multiplier, **accounting)
    print_json({"epsilon": epsilon, "accountant": args.accountant, **_tight(args.noise_multiplier, accounting)})
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from tasks.cli import print_json
    from vip_core.privacy.accounting import calibrate_noise_multiplier, compute_epsilon

    accounting = dict(sample_rate=args.sample_rate, steps=args.steps, delta=args.delta, accountant=args.accountant)
    sigma = calibrate_noise_multiplier(target_epsilon=args.target_epsilon, **accounting)
    epsilon = compute_epsilon(noise_multiplier=sigma, **accounting)
    print_json({"noise_multiplier": sigma, "epsilon": epsilon, "accountant": args.accountant,
                **_tight(sigma, accounting)})
    return 0


def _tight(sigma: float, accounting: dict) -> dict[str, float]:
    """``epsilon_pld`` beside an RDP ε (loose; the ViP paper's accountant): the tight bound of the same σ."""
    from vip_core.privacy.accounting import compute_epsilon

    if accounting["accountant"] != "rdp":
        return {}
    return {"epsilon_pld": compute_epsilon(noise_multiplier=sigma, **{**accounting, "accountant": "pld"})}
