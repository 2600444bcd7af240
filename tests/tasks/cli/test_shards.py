"""``vip shards --check DIR``: the damaged images named, in this process and on a local Ray; exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

VIP = [sys.executable, "-m", "tasks.cli"]


def _check(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(VIP + ["shards", "--check", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("distributor", ["multiprocessing", "ray"])
def test_the_check_names_each_damaged_image_and_exits_1(damaged_shards, distributor):
    folder, damaged = damaged_shards
    result = _check(str(folder), "--distributor", distributor)
    assert result.returncode == 1, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert (report["shards"], report["images"], report["unreadable"], report["ok"]) == (2, 64, [], False)
    assert {item["member"]: Path(item["shard"]).name for item in report["damaged"]} == damaged


def test_clean_shards_pass_and_a_missing_folder_is_one_line(noise_shards, tmp_path):
    result = _check(str(noise_shards(64)))
    assert result.returncode == 0 and json.loads(result.stdout)["damaged"] == []
    missing = _check(str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert missing.stderr.startswith("vip shards: error: shard folder") and "does not exist" in missing.stderr
