"""The ``vip`` command: each stage (and the benchmarks) without Prefect, on explicit paths.

Each sub-command lives in ``tasks/cli/<name>.py`` and defines ``register(subparsers)``, which adds its
parser (with the shared options of ``tasks/cli/options.py``) and a handler ``function(args) -> int``.
A handler parses, calls one stage function and prints one JSON object on stdout where the command
reports a result (:func:`report`); while it runs, whatever else prints on stdout goes to stderr. A bad argument or
bad input exits with code 2 and one line on stderr that names the problem, never a traceback.

Run as a program, the commands that start processes (Ray, renderers, img2dataset) run supervised
(:mod:`tasks.runtime.stopping`): Ctrl-C stops them and all they started within seconds, with one line saying
what was kept and how to resume, exit code 130. A command that sizes its work (``sizer``: pretrain, render) says
so first and asks before a run far beyond a CPU demo on a machine without a GPU (``--yes``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from typing import Any, Iterator, Sequence, TextIO

from tasks.runtime.environment import configure_environment
from tasks.runtime.stopping import INTERRUPTED, is_supervised, kept_work, run_supervised, stop_with_supervisor

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
# The commands whose work is in processes of their own; the others stop on Ctrl-C in their own process.
SUPERVISED_COMMANDS = ("render", "ingest", "eval", "bench", "pretrain", "audit", "shards")
# How to resume a stopped command, where it is more than running it again.
RESUME_HINTS = {"pretrain": "the same command with --resume (training goes on from its last checkpoint)",
                "bench": "nothing to resume: a benchmark starts over"}


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
    report(json.dumps(payload, sort_keys=False))


# The program's stdout while a command runs: only what the command reports goes there.
_REPORTS: list[TextIO] = []


def report(text: str, end: str = "\n") -> None:
    """Writes what the command reports (its JSON object, or its lines) on stdout."""
    sink = _REPORTS[-1] if _REPORTS else sys.stdout
    sink.write(text + end)
    sink.flush()


@contextlib.contextmanager
def _stdout_for_reports() -> Iterator[None]:
    """Sends whatever else prints on stdout to stderr while a command runs: Ray's driver prints its workers'
    errors (a killed worker's, say) on stdout, which would break the command's one JSON object."""
    _REPORTS.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _REPORTS.pop()


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a ``vip`` command; ``argv`` None: the program's own command line, the long commands supervised."""
    configure_environment()
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if as_program and args.command in SUPERVISED_COMMANDS:
            if not is_supervised():
                return _supervise(args, argv)
            stop_with_supervisor()
        with _stdout_for_reports():
            code = args.handler(args)
    except (UsageError, ValueError, FileNotFoundError) as error:
        print(f"vip {args.command}: error: {first_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nvip {args.command}: stopped", file=sys.stderr)
        return INTERRUPTED
    return int(code or 0)


def _supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """The size line and the confirmation where the command sizes its work, then the command in a supervised child."""
    sizer = getattr(args, "sizer", None)
    if sizer is not None:
        from tasks.runtime.sizing import confirm

        size = sizer(args)
        print(f"vip {args.command}: {size.line()}", file=sys.stderr, flush=True)
        refusal = confirm(size, yes=args.yes, flag="--yes")
        if refusal:
            raise UsageError(refusal)
    return run_supervised([sys.executable, "-m", "tasks.cli", *argv], stopped=lambda: stopped_line(args))


def stopped_line(args: argparse.Namespace) -> str:
    """What a stopped command kept (in its ``--output``) and how to resume it."""
    output = getattr(args, "output", None)
    kept = f" Kept in {output}: {kept_work(output) or 'its complete pieces'}." if output else ""
    hint = RESUME_HINTS.get(args.command, "the same command again (what was finished is kept)")
    return f"vip {args.command}: stopped.{kept} To resume: {hint}."


def first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


if __name__ == "__main__":
    sys.exit(main())
