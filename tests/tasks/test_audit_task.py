"""The audit task and ``vip audit``: audit.json, MLflow metrics beside the accountant's ε, re-runs skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vip_core.config import get_preset, with_overrides

ROOT = Path(__file__).resolve().parents[2]
# A short DP run: 3 steps, 100 canaries; enough to exercise the task, not to have power.
CONFIG = with_overrides(get_preset("tiny"), {"privacy.delta": 1e-5, "privacy.target_epsilon": 4.0, "private.steps": 3})


def _metrics(run_id: str) -> dict[str, float]:
    from tasks.tracking import client

    return client().get_run(run_id).data.metrics


def test_audit_logs_beside_the_accountants_epsilon_and_is_not_redone(tmp_path):
    from tasks.audit import run_audit
    from tasks.tracking import log_metrics, start_run

    training_run = start_run("pretrain-dp")
    log_metrics(training_run, {"privacy/epsilon": 3.9})
    result = run_audit(CONFIG, 100, str(tmp_path / "audit"), mlflow_run_id=training_run)

    assert result["canaries"] == 100 and result["mlflow_run_id"] == training_run
    assert 3.9 < result["epsilon_claimed"] <= 4.0
    assert 0 <= result["epsilon_lower_bound"] <= result["epsilon_claimed"]
    metrics = _metrics(training_run)
    assert metrics["privacy/epsilon"] == 3.9
    assert metrics["audit/epsilon_claimed"] == pytest.approx(result["epsilon_claimed"])
    assert metrics["audit/epsilon_lower_bound"] == pytest.approx(result["epsilon_lower_bound"])
    stored = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert stored["result"]["correct_guesses"] == result["correct_guesses"]

    again = run_audit(CONFIG, 100, str(tmp_path / "audit"), mlflow_run_id=training_run)
    assert again["skipped"] and again["epsilon_lower_bound"] == result["epsilon_lower_bound"]
    with pytest.raises(ValueError, match="another configuration"):
        run_audit(CONFIG, 200, str(tmp_path / "audit"))


def test_vip_audit_prints_one_json_object_and_logs_a_new_run(tmp_path):
    command = [sys.executable, "-m", "tasks.cli", "audit", "--preset", "tiny", "--canaries", "100", "--delta", "1e-5",
               "--no-privacy", "--output", str(tmp_path / "cli"), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    payload = json.loads(lines[0])
    assert {"epsilon_claimed", "epsilon_lower_bound", "canaries", "correct_guesses"} <= set(payload)
    assert payload["epsilon_claimed"] is None and payload["canaries"] == 100
    assert payload["epsilon_lower_bound"] > 1.0  # non-private: even 100 canaries show leakage
    assert _metrics(payload["mlflow_run_id"])["audit/epsilon_lower_bound"] == pytest.approx(payload["epsilon_lower_bound"])


@pytest.mark.parametrize(("argument", "value"), [("--canaries", "1"), ("--canaries", "many"), ("--preset", "vip-huge")])
def test_vip_audit_bad_argument_exits_2_naming_it(argument, value):
    result = subprocess.run([sys.executable, "-m", "tasks.cli", "audit", argument, value], capture_output=True,
                            text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert argument.removeprefix("--") in lines[0]
