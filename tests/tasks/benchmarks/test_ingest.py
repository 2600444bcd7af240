"""``vip bench ingest``: the stage's rate beside img2dataset's alone, from one run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[3]

VIP = [sys.executable, "-m", "tasks.cli"]


@pytest.mark.slow
def test_bench_ingest_reports_both_rates_from_one_run():
    result = subprocess.run(
        VIP + ["bench", "ingest", "--json", "--num-images", "60", "--samples-per-shard", "30", "--eval-images", "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["img2dataset_images_per_s"] > 0 and figures["stage_images_per_s"] > 0
    assert figures["overhead"] == pytest.approx(figures["stage_seconds"] / figures["img2dataset_seconds"] - 1, abs=0.01)
