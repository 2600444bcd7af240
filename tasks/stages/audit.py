"""The audit task: an empirical lower bound on ε for a private training run, logged beside the accountant's ε.

``run_audit`` trains the configuration's model with its private-stage recipe (the step, schedule and plan
pre-training runs) and ``canaries`` white-box gradient canaries, half of them included at random, and turns
the canaries' scores into a lower bound on ε at the claim's δ (``privacy.delta``, else 0.01/canaries;
Steinke, Nasr and Jagielski, 2023; see :mod:`vip_core.eval.audit`). It writes ``audit.json`` in ``output``
(a stage folder: another configuration's audit there is refused) and logs
``audit/epsilon_lower_bound`` and ``audit/epsilon_claimed`` to the MLflow run ``mlflow_run_id`` (the private
pre-training run, where ``privacy/epsilon`` is) or to a new run. Running it again with the same
configuration and canaries returns the stored result.
"""

from __future__ import annotations

import logging
from typing import Any

from tasks.runtime.folders import StageFolder
from vip_core.config import VipConfig

log = logging.getLogger(__name__)

RESULT_FILE = "audit.json"


def run_audit(config: VipConfig, canaries: int, output: str, mlflow_run_id: str | None = None) -> dict[str, Any]:
    """Audits ``config``'s private training with ``canaries`` canaries; returns the result.

    Args:
        config: the run's configuration; ``privacy.enabled=False`` audits the non-private run.
        canaries: m, the number of canaries (each included with probability 1/2).
        output: folder for ``audit.json``; a folder holding another configuration's audit is refused.
        mlflow_run_id: the MLflow run to log into; a new run ``audit`` when None.

    Returns:
        ``epsilon_claimed`` (None without privacy), ``epsilon_lower_bound``, ``canaries``, ``correct_guesses``,
        ``guesses``, ``delta`` (the δ of the claim), the run's settings, ``output`` and ``mlflow_run_id``.
    """
    from vip_core.eval.audit import audit

    folder = StageFolder(output, "audit", {"config": config.model_dump(mode="json"), "canaries": canaries},
                         result_name=RESULT_FILE)
    stored = folder.stored_result()
    if stored is not None:
        log.info("audit of this configuration already in %s", output)
        return {**stored, "skipped": True}
    folder.claim()
    result = audit(config, canaries, seed=config.private.seed)
    result["mlflow_run_id"] = _log_to_mlflow(result, config, mlflow_run_id)
    result["output"] = str(output)
    return folder.store_result(result)


def _log_to_mlflow(result: dict[str, Any], config: VipConfig, run_id: str | None) -> str:
    """Logs the audit's metrics into ``run_id`` (or a new run) and returns that run's id."""
    from tasks.runtime import tracking

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
