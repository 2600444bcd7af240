"""What the stage and command tests share: the small public sets of evaluation, a saved tiny checkpoint and
every job's metrics on it, made once per session (the jobs take a while on two cores); shards of noise images;
a two-node Ray cluster on this machine; the wait for a killed command's processes to be gone."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from PIL import Image

from tasks.fixtures.eval_sets import make_ade20k_shapes, make_coco_shapes, make_digits_imagefolder
from tasks.stages.eval import run_evaluation
from vip_core.config import tiny
from vip_core.data.shards import ShardWriter, encode_image
from vip_core.models import build_mae, save_checkpoint

EVAL_DATA = {"linprobe": "digits", "finetune": "digits", "fewshot": "digits", "coco": "coco", "ade20k": "ade20k"}


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """``(root, config, checkpoint)``: the sets below ``root`` and an untrained tiny MAE's checkpoint."""
    root = tmp_path_factory.mktemp("evaluate")
    make_digits_imagefolder(root / "digits", img_size=32, per_class=30)
    make_coco_shapes(root / "coco", img_size=32, n=12)
    make_ade20k_shapes(root / "ade20k", img_size=32, n=12)
    config = tiny()
    torch.manual_seed(0)
    checkpoint = save_checkpoint(root / "run", model=build_mae(config.model), config=config, stage="private", step=0)
    return root, config, checkpoint


@pytest.fixture(scope="session")
def evaluations(workspace):
    """Every job's metrics on the checkpoint, written to ``root/out/<task>``."""
    root, config, checkpoint = workspace
    return {task: run_evaluation(config, task, str(checkpoint), str(root / data), str(root / "out" / task))
            for task, data in EVAL_DATA.items()}


@pytest.fixture(scope="session")
def noise_shards(tmp_path_factory):
    """``noise_shards(count)``: a folder of ``count`` random 32 px PNG images in shards of 32, made once per count."""
    made = {}

    def make(count: int):
        if count not in made:
            folder = tmp_path_factory.mktemp(f"noise-shards-{count}")
            with ShardWriter(folder, prefix="img", samples_per_shard=32) as writer:
                for i in range(count):
                    pixels = np.random.default_rng(i).integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
                    writer.write(f"{i:05d}", {"png": encode_image(Image.fromarray(pixels), "png")})
            made[count] = folder
        return made[count]

    return make


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


def wait_until_session_ends(session: int, timeout_s: float = 30.0) -> None:
    """Returns once no process of ``session`` runs (zombies aside); after ``timeout_s``, kills those still running
    and fails naming them (a failed test leaves nothing going)."""
    deadline = time.monotonic() + timeout_s
    while running := _running_in(session):
        if time.monotonic() > deadline:
            for process in running:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            raise AssertionError(f"still running: {[process.info['name'] for process in running]}")
        time.sleep(0.1)


def _running_in(session: int) -> list[psutil.Process]:
    running = []
    for process in psutil.process_iter(["name"]):
        try:
            if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except (psutil.Error, ProcessLookupError):
            continue
    return running
