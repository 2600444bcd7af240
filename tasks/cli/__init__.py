"""The ``vip`` command: each stage (and the benchmarks) without Prefect, on explicit paths.

Each sub-command lives in ``tasks/cli/<name>.py`` and defines ``register(subparsers)``, which adds its
parser (with the shared options of ``tasks/cli/options.py``) and a handler ``function(args) -> int``.
A handler parses, calls one stage function and prints one JSON object on stdout where the command
reports a result. A bad argument or bad input exits with code 2 and one line on stderr that names the
problem, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Sequence

from tasks.runtime.environment import configure_environment

COMMAND_MODULES = (
    "tasks.cli.config",
    "tasks.cli.privacy",
    "tasks.cli.render",
    "tasks.cli.ingest",
    "tasks.cli.eval",
    "tasks.cli.bench",
    "tasks.cli.pretrain",
    "tasks.cli.audit",
    "tasks.cli.shards",
    "tasks.cli.export",
)


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``vip privacy epsilon: error: ...``) and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="vip", description="Differentially private foundation models for vision.")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def print_json(payload: dict[str, Any]) -> None:
    """The one JSON object a command reports, on stdout."""
    print(json.dumps(payload, sort_keys=False), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    configure_environment()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.handler(args)
    except (UsageError, ValueError, FileNotFoundError) as error:
        print(f"vip {args.command}: error: {first_line(error)}", file=sys.stderr)
        return 2
    return int(code or 0)


def first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


if __name__ == "__main__":
    sys.exit(main())
