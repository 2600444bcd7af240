"""Test-wide set-up: every test session keeps its state in a fresh VIP_HOME, telemetry off, and every test
its privacy ledgers in a folder of its own."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

os.environ["VIP_HOME"] = tempfile.mkdtemp(prefix="vip-test-home-")

from tasks.runtime.environment import configure_environment  # noqa: E402

configure_environment()


import pytest  # noqa: E402


@contextlib.contextmanager
def own_ledgers(tmp_path_factory) -> Iterator[Path]:
    """Charges private data sets to ledgers in a fresh folder while the context lasts."""
    folder = tmp_path_factory.mktemp("ledgers")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VIP_LEDGER_DIR", str(folder))
        yield folder


@pytest.fixture(autouse=True, scope="module")
def module_privacy_ledgers(tmp_path_factory):
    """The module-scoped fixtures of a test module charge ledgers of the module's own."""
    with own_ledgers(tmp_path_factory) as folder:
        yield folder


@pytest.fixture(autouse=True)
def own_privacy_ledgers(tmp_path_factory, module_privacy_ledgers):
    """Each test charges private data sets to ledgers of its own: runs of other tests on identical fixture
    data would otherwise be composed into its ε (as they would be for a real data set)."""
    with own_ledgers(tmp_path_factory) as folder:
        yield folder
