"""Fixtures of the ``vip`` command tests."""

from __future__ import annotations

from typing import Callable

import pytest


@pytest.fixture
def vip_here(capsys) -> Callable[..., tuple[int, str, str]]:
    """``vip ARGS`` through the entry point in this process (a subprocess costs seconds of imports): (exit code,
    stdout, stderr), argparse's exits included."""
    from tasks.cli import main

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            code = main(list(argv))
        except SystemExit as stop:
            code = int(stop.code)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
