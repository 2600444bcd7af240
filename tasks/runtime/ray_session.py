"""Ray start-up: connect to the cluster named by ``RAY_ADDRESS``, or start a small local Ray.

A local Ray starts about nine processes (about 0.7 GB). It is started with the CPUs the training
workers ask for (fractional CPUs allowed per worker), no dashboard and a small object store, and its
session files live under ``$VIP_HOME/ray``. :func:`ray_session` shuts down only a Ray it started.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tasks.runtime.environment import configure_environment, state_paths

log = logging.getLogger(__name__)

# Unix socket paths are limited to 107 bytes; Ray's session paths add about 70 to the temp folder.
_MAX_TEMP_DIR_CHARS = 36
_LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2


def cluster_address() -> str | None:
    """The address of an existing cluster to join (``RAY_ADDRESS``), or None for a local Ray."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    return address or None


def local_cpus(num_workers: int, cpus_per_worker: float) -> int:
    """CPUs a local Ray advertises: enough for the workers, at least the machine's cores."""
    return max(os.cpu_count() or 1, math.ceil(num_workers * cpus_per_worker))


def ray_temp_dir() -> Path:
    """``$VIP_HOME/ray``, or a short folder under /tmp where that path is too long for Ray's sockets."""
    preferred = state_paths()["ray"]
    if len(str(preferred)) <= _MAX_TEMP_DIR_CHARS:
        preferred.mkdir(parents=True, exist_ok=True)
        return preferred
    return Path(tempfile.mkdtemp(prefix="vip-ray-"))


@contextmanager
def ray_session(num_workers: int = 1, cpus_per_worker: float = 1.0) -> Iterator[dict]:
    """Ray, ready for a TorchTrainer with ``num_workers`` workers of ``cpus_per_worker`` CPUs each.

    Joins ``RAY_ADDRESS`` when it is set (the cluster must have the CPUs), else starts a local Ray
    and stops it on exit. Yields ``{"address", "local", "cpus"}``.
    """
    configure_environment()
    import ray

    if ray.is_initialized():
        yield _describe(ray, local=False)
        return
    address = cluster_address()
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        _check_cluster_cpus(ray, num_workers * cpus_per_worker)
    else:
        ray.init(
            address="local",
            num_cpus=local_cpus(num_workers, cpus_per_worker),
            include_dashboard=False,
            object_store_memory=_LOCAL_OBJECT_STORE_BYTES,
            _temp_dir=str(ray_temp_dir()),
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    try:
        yield _describe(ray, local=address is None)
    finally:
        ray.shutdown()


def worker_environment() -> dict[str, str]:
    """The variables Ray Train workers need to find vip's state, the MLflow store and an S3-compatible endpoint,
    also on another node (credentials stay with the nodes: environment, instance role or credentials file)."""
    keys = ("VIP_HOME", "MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")
    return {key: os.environ[key] for key in keys if key in os.environ}


def _describe(ray_module, local: bool) -> dict:
    return {
        "address": ray_module.get_runtime_context().gcs_address,
        "local": local,
        "cpus": ray_module.cluster_resources().get("CPU", 0.0),
    }


def _check_cluster_cpus(ray_module, needed: float) -> None:
    available = ray_module.cluster_resources().get("CPU", 0.0)
    if available < needed:
        ray_module.shutdown()
        raise ValueError(
            f"the Ray cluster at {cluster_address()} has {available:g} CPUs; the training workers need {needed:g}"
        )
