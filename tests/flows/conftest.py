"""The Prefect API of the flow tests: a temporary Prefect server on its own sqlite database, shared by the
session (slow to start on a loaded machine)."""

from __future__ import annotations

import pytest
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=300):
        yield
