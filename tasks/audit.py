"""The audit task: an empirical lower bound on ε for a private training run, logged beside the accountant's ε.

``run_audit`` trains the configuration's model with its private-stage settings (batch size, steps, clipping
bound, σ calibrated by the accountant, δ) and ``canaries`` white-box gradient canaries, half of them
included at random, and turns the canaries' scores into a lower bound on ε at the run's δ (Steinke, Nasr
and Jagielski, 2023; see :mod:`vip_core.eval.audit`). It writes ``audit.json`` in ``output`` and logs
``audit/epsilon_lower_bound`` and ``audit/epsilon_claimed`` to the MLflow run ``mlflow_run_id`` (the private
pre-training run, where ``privacy/epsilon`` is) or to a new run. Running it again with the same
configuration and canaries returns the stored result.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from vip_core.config import VipConfig

log = logging.getLogger(__name__)

RESULT_FILE = "audit.json"


def run_audit(config: VipConfig, canaries: int, output: str, mlflow_run_id: str | None = None) -> dict[str, Any]:
    """Audits ``config``'s private training with ``canaries`` canaries; returns the result.

    Args:
        config: the run's configuration; ``privacy.enabled=False`` audits the non-private run.
        canaries: m, the number of canaries (each included with probability 1/2).
        output: folder for ``audit.json``.
        mlflow_run_id: the MLflow run to log into; a new run ``audit`` when None.

    Returns:
        ``epsilon_claimed`` (None without privacy), ``epsilon_lower_bound``, ``canaries``, ``correct_guesses``,
        ``guesses``, the run's settings, ``output`` and ``mlflow_run_id``.
    """
    from vip_core.eval.audit import audit

    folder = Path(output)
    stored = _stored_result(folder, config, canaries)
    if stored is not None:
        log.info("audit of this configuration already in %s", folder)
        return stored
    result = audit(config, canaries, seed=config.private.seed)
    result["mlflow_run_id"] = _log_to_mlflow(result, config, mlflow_run_id)
    result["output"] = str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"config": config.model_dump(mode="json"), "result": result}
    temporary = folder / f".{RESULT_FILE}.tmp"
    temporary.write_text(json.dumps(record, indent=2))
    temporary.replace(folder / RESULT_FILE)
    return result


def _stored_result(folder: Path, config: VipConfig, canaries: int) -> dict[str, Any] | None:
    path = folder / RESULT_FILE
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("config") != config.model_dump(mode="json") or record["result"].get("canaries") != canaries:
        raise ValueError(f"{folder} holds the audit of another configuration: choose a new output folder")
    return {**record["result"], "skipped": True}


def _log_to_mlflow(result: dict[str, Any], config: VipConfig, run_id: str | None) -> str:
    """Logs the audit's metrics into ``run_id`` (or a new run) and returns that run's id."""
    from tasks import tracking

    metrics = {"audit/epsilon_lower_bound": result["epsilon_lower_bound"],
               "audit/correct_guesses": result["correct_guesses"], "audit/guesses": result["guesses"]}
    if result["epsilon_claimed"] is not None:
        metrics["audit/epsilon_claimed"] = result["epsilon_claimed"]
    if run_id is not None:
        tracking.log_metrics(run_id, metrics)
        return run_id
    with tracking.run("audit", config=config, tags={tracking.STAGE_TAG: "audit"}) as new_run_id:
        tracking.log_metrics(new_run_id, metrics)
    return new_run_id
