"""The one place that sets the process environment: telemetry off, all state under one folder.

Every entry point (the ``vip`` command, the flows, the tests) calls :func:`configure_environment`
before it imports Prefect, Ray, MLflow or img2dataset.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOME = ".vip"

# Telemetry, update checks and hub downloads off. Values are defaults: a user's setting wins.
QUIET_DEFAULTS: dict[str, str] = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_UI_ENABLED": "true",
    "DO_NOT_TRACK": "1",
    "NO_ALBUMENTATIONS_UPDATE": "1",
    "WANDB_MODE": "disabled",
    "WANDB_SILENT": "true",
    "HF_HUB_OFFLINE": "1",
    "TQDM_DISABLE": "1",
    "PYTHONWARNINGS": "ignore::DeprecationWarning",
}


def vip_home() -> Path:
    """The folder that holds all of vip's state: ``$VIP_HOME``, else ``./.vip``."""
    return Path(os.environ.get("VIP_HOME", DEFAULT_HOME)).expanduser().resolve()


def state_paths(home: Path | None = None) -> dict[str, Path]:
    """Where each component keeps its state, all below ``home`` but the privacy ledgers of private data sets,
    which ``VIP_LEDGER_DIR`` may put elsewhere (a folder a team shares, so that every run on a data set is
    charged to one ledger)."""
    home = home or vip_home()
    return {
        "home": home,
        "prefect": home / "prefect",
        "mlflow": home / "mlflow",
        "mlflow_db": home / "mlflow" / "mlflow.db",
        "mlflow_artifacts": home / "mlflow" / "artifacts",
        "ray": home / "ray",
        "data": home / "data",
        "runs": home / "runs",
        "ledgers": Path(os.environ["VIP_LEDGER_DIR"]) if os.environ.get("VIP_LEDGER_DIR") else home / "ledgers",
    }


def configure_environment() -> Path:
    """Sets telemetry off and points Prefect and MLflow at ``vip_home()``; returns the home.

    Idempotent. Variables the user already set are kept.
    """
    paths = state_paths()
    for key in ("home", "prefect", "mlflow", "mlflow_artifacts"):
        paths[key].mkdir(parents=True, exist_ok=True)
    os.environ["VIP_HOME"] = str(paths["home"])
    for key, value in QUIET_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("PREFECT_HOME", str(paths["prefect"]))
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{paths['mlflow_db']}")
    return paths["home"]
