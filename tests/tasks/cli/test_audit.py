"""``vip audit``: one JSON object on stdout, a new MLflow run, bad arguments refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _metrics(run_id: str) -> dict[str, float]:
    from tasks.runtime.tracking import client

    return client().get_run(run_id).data.metrics


def test_vip_audit_prints_one_json_object_and_logs_a_new_run(tmp_path):
    command = [sys.executable, "-m", "tasks.cli", "audit", "--preset", "tiny", "--canaries", "100", "--no-privacy",
               "--output", str(tmp_path / "cli"), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    payload = json.loads(lines[0])
    assert {"epsilon_claimed", "epsilon_lower_bound", "canaries", "correct_guesses"} <= set(payload)
    assert payload["epsilon_claimed"] is None and payload["canaries"] == 100
    assert payload["delta"] == 0.01 / 100  # the δ it claims at, where the bound has power
    assert payload["epsilon_lower_bound"] > 1.0  # non-private: even 100 canaries show leakage
    assert _metrics(payload["mlflow_run_id"])["audit/epsilon_lower_bound"] == pytest.approx(payload["epsilon_lower_bound"])


@pytest.mark.parametrize(("argument", "value"), [("--canaries", "1"), ("--canaries", "many"), ("--preset", "vip-huge")])
def test_vip_audit_bad_argument_exits_2_naming_it(argument, value, vip_here):
    code, _, err = vip_here("audit", argument, value)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert argument.removeprefix("--") in lines[0]
