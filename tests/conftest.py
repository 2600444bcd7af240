"""Test-wide set-up: every test session keeps its state in a fresh VIP_HOME, telemetry off."""

from __future__ import annotations

import os
import tempfile

os.environ["VIP_HOME"] = tempfile.mkdtemp(prefix="vip-test-home-")

from tasks.runtime.environment import configure_environment  # noqa: E402

configure_environment()
