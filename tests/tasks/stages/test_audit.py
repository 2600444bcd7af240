"""The audit task: audit.json, MLflow metrics beside the accountant's ε, re-runs skipped."""

from __future__ import annotations

import json

import pytest
import torch

from vip_core.config import get_preset, with_overrides

# A short DP run: 3 steps, 100 canaries; enough to exercise the task, not to have power.
CONFIG = with_overrides(get_preset("tiny"), {"privacy.delta": 1e-5, "privacy.target_epsilon": 4.0, "private.steps": 3})


def _metrics(run_id: str) -> dict[str, float]:
    from tasks.runtime.tracking import client

    return client().get_run(run_id).data.metrics


def test_audit_logs_beside_the_accountants_epsilon_and_is_not_redone(tmp_path):
    from tasks.stages.audit import run_audit
    from tasks.runtime.tracking import log_metrics, start_run

    training_run = start_run("pretrain-dp")
    log_metrics(training_run, {"privacy/epsilon": 3.9})
    generator_state = torch.get_rng_state()
    result = run_audit(CONFIG, 100, str(tmp_path / "audit"), mlflow_run_id=training_run)
    assert torch.equal(torch.get_rng_state(), generator_state), "it runs beside the evaluation jobs: no global draws"

    assert result["canaries"] == 100 and result["mlflow_run_id"] == training_run
    assert 3.9 < result["epsilon_claimed"] <= 4.0
    assert 0 <= result["epsilon_lower_bound"] <= result["epsilon_claimed"]
    metrics = _metrics(training_run)
    assert metrics["privacy/epsilon"] == 3.9
    assert metrics["audit/epsilon_claimed"] == pytest.approx(result["epsilon_claimed"])
    assert metrics["audit/epsilon_lower_bound"] == pytest.approx(result["epsilon_lower_bound"])
    stored = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert stored["correct_guesses"] == result["correct_guesses"] and stored["delta"] == 1e-5

    again = run_audit(CONFIG, 100, str(tmp_path / "audit"), mlflow_run_id=training_run)
    assert again["skipped"] and again["epsilon_lower_bound"] == result["epsilon_lower_bound"]
    with pytest.raises(ValueError, match="holds audit work made with canaries=100, not 200"):
        run_audit(CONFIG, 200, str(tmp_path / "audit"))
