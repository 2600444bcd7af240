"""Two Ray nodes on this machine: a head and a second node started with ``ray start``; the pre-training
joins them through ``RAY_ADDRESS`` and trains one worker on each."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from vip_core.models.checkpoint import load_checkpoint

RAY = str(Path(sys.executable).with_name("ray"))
# The test cluster lives on loopback: no token to hand from the head to the second node.
CLUSTER_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ray_start(*args: str) -> None:
    env = {**os.environ, **CLUSTER_ENV}
    env.pop("RAY_ADDRESS", None)
    subprocess.run([RAY, "start", *args, "--disable-usage-stats"], env=env, check=True, capture_output=True, timeout=180)


def _stop_cluster(temp_dir: Path) -> None:
    """Kills, by process id, every process of this test cluster (``ray stop`` would stop every Ray on the
    machine): those whose command line names the cluster's temp folder, and their children."""
    doomed: set[psutil.Process] = set()
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(str(temp_dir) in part for part in process.info["cmdline"] or []):
                doomed.add(process)
                doomed.update(process.children(recursive=True))
        except psutil.Error:
            continue
    for process in doomed:
        try:
            process.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(list(doomed), timeout=30)


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    """A head and a second node on this machine, one CPU each; yields the head's address."""
    temp_dir = Path(tmp_path_factory.mktemp("ray2n"))
    try:
        _ray_start("--head", "--node-ip-address=127.0.0.1", f"--port={_free_port()}", "--num-cpus=1",
                   "--include-dashboard=false", f"--temp-dir={temp_dir}")
        address = (temp_dir / "ray_current_cluster").read_text().strip()
        _ray_start(f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=1", f"--temp-dir={temp_dir}")
        yield address
    finally:
        _stop_cluster(temp_dir)


@pytest.fixture(scope="module")
def shards(noise_shards):
    return noise_shards(64)


# The pre-training runs in a driver process of its own, as a user's would: a process that already ran and
# shut down a local Ray (as earlier tests in this session do) cannot reliably join another cluster.
_DRIVER = """
import json, sys
from pathlib import Path
from tasks.stages.pretrain import run_pretrain
from vip_core.config import get_preset, with_overrides

config = with_overrides(get_preset("tiny"), json.loads(sys.argv[1]))
result = run_pretrain(config, "synthetic", Path(sys.argv[2]), Path(sys.argv[3]))
print("RESULT " + json.dumps({key: result[key] for key in ("nodes", "workers", "steps", "checkpoint")}))
"""


def test_training_spans_two_nodes_on_this_machine(two_node_cluster, shards, tmp_path):
    # 0.75 CPU per worker and one CPU per node: the two workers cannot share a node.
    overrides = {
        "synthetic.num_workers": 2, "synthetic.cpus_per_worker": 0.75, "synthetic.steps": 2,
        "synthetic.batch_size": 16, "synthetic.physical_batch_size": 16, "synthetic.checkpoint_every": 2,
    }
    env = {**os.environ, **CLUSTER_ENV, "RAY_ADDRESS": two_node_cluster}
    driver = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(overrides), str(shards), str(tmp_path / "out")],
        env=env, cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=600,
    )
    assert driver.returncode == 0, driver.stderr[-3000:]
    result = json.loads(driver.stdout.rsplit("RESULT ", 1)[1])
    assert result["nodes"] == 2 and result["workers"] == 2
    assert result["steps"] == 2
    assert load_checkpoint(result["checkpoint"])["step"] == 2
