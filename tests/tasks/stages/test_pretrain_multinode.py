"""Two Ray nodes on this machine (``two_node_cluster``); the pre-training joins them through ``RAY_ADDRESS`` and
trains one worker on each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tasks.conftest import CLUSTER_ENV
from vip_core.models.checkpoint import load_checkpoint

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
