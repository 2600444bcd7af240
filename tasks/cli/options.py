"""The options the ``vip`` sub-commands share, one spelling each, and argument types with one-line errors.

``--preset NAME`` (checked against the registry while parsing), ``--output DIR`` (the folder the command
writes; always explicit: the flows, not the command, name the pipeline's folders), ``--data DIR``,
``--mlflow-parent RUN_ID`` (record the command's stage as a child run of that MLflow run), ``--json``, ``--yes``
(start a long run without the confirmation, :mod:`tasks.runtime.sizing`).
A command's config is the preset, then ``--config FILE``, then its flags that override config fields
(:func:`add_config_flags`), then every ``--set FIELD=VALUE``: :func:`config_from` layers them, the make targets'
programs too.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Mapping

from vip_core.config import PRESETS, VipConfig, resolve_config


def add_command(subparsers: Any, name: str, handler: Callable[[argparse.Namespace], int], *, help: str,
                description: str | None = None) -> argparse.ArgumentParser:
    """A sub-command parser whose arguments go to ``handler(args) -> exit code``."""
    parser = subparsers.add_parser(name, help=help, description=description or help)
    parser.set_defaults(handler=handler)
    return parser


def add_preset(parser: argparse.ArgumentParser) -> None:
    """The options that make a command's config: ``--preset``, then :func:`add_config_sources`' file and settings."""
    parser.add_argument("--preset", default="tiny", type=preset_name, help="configuration preset (default: tiny)")
    add_config_sources(parser)


def add_config_sources(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and repeatable ``--set FIELD=VALUE``, which :func:`config_from` layers on the preset."""
    parser.add_argument("--config", metavar="FILE", help="a config file (YAML, TOML or JSON) of some or all fields, "
                        "over the preset (`vip config show` prints a whole one)")
    parser.add_argument("--set", action="append", default=[], dest="settings", metavar="FIELD=VALUE",
                        help="set one config field, the value read as YAML (privacy.target_epsilon=4, "
                        "evaluation.tasks=[linprobe,coco]); repeatable, applied last")


def add_output(parser: argparse.ArgumentParser, holds: str) -> None:
    parser.add_argument("--output", required=True, metavar="DIR", help=f"the folder for {holds}")


def add_data(parser: argparse.ArgumentParser, holds: str) -> None:
    parser.add_argument("--data", required=True, metavar="DIR",
                        help=f"the folder of {holds}: a local path or an fsspec URL (s3://bucket/folder)")


def add_mlflow_parent(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mlflow-parent", metavar="RUN_ID",
                        help="record this stage as a child run of that MLflow run (default: a run of its own)")


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def add_yes(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--yes", action="store_true",
                        help="start a run far beyond a CPU demo on a machine without a GPU without asking")


def add_config_flags(parser: argparse.ArgumentParser, flags: dict[str, tuple[str, type, str]]) -> None:
    """Options that override config fields: ``{flag: (dotted field, type, help)}``; a flag left out keeps the
    preset's value."""
    for flag, (_, kind, text) in flags.items():
        parser.add_argument(flag, type=kind, help=text)


def config_from(args: argparse.Namespace, flags: dict[str, tuple[str, type, str]] | None = None,
                overrides: Mapping[str, Any] | None = None) -> VipConfig:
    """The preset, then the ``--config`` file, then the config flags given (``--batch-size`` sets its field) and
    ``overrides`` (the fields of a command's other flags), then the ``--set`` settings."""
    fields = {}
    for flag, (field, _, _) in (flags or {}).items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None:
            fields[field] = value
    return resolve_config(args.preset, file=args.config, overrides={**fields, **(overrides or {})},
                          settings=args.settings)


def preset_name(text: str) -> str:
    """A name in the preset registry."""
    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {text!r} (known: {', '.join(PRESETS)})")
    return text


def number(rule: str, accepts: Callable[[float], bool]) -> Callable[[str], float]:
    """A finite float that satisfies ``accepts`` (described by ``rule``: ``"> 0"``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and accepts(value)):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


def count(minimum: int) -> Callable[[str], int]:
    """An integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    return parse
