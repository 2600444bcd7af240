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
        VIP + ["bench", "ingest", "--json", "--num-images", "60", "--samples-per-shard", "30", "--eval-images", "5",
               "--dedup-hashes", "20000", "80000", "--dedup-rows-per-partition", "20000"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["img2dataset_images_per_s"] > 0 and figures["stage_images_per_s"] > 0
    assert figures["overhead"] == pytest.approx(figures["stage_seconds"] / figures["img2dataset_seconds"] - 1, abs=0.01)
    assert figures["clean_images_per_cpu_s"] == pytest.approx(60 / figures["clean_cpu_s"], rel=0.01)
    assert (figures["dedup_hashes_small"], figures["dedup_hashes_large"]) == (20000, 80000)
    assert (figures["dedup_partitions_small"], figures["dedup_partitions_large"]) == (1, 4)
    assert figures["dedup_s_small"] > 0 and figures["dedup_s_large"] > 0
    assert figures["dedup_peak_mb_large"] >= figures["dedup_idle_worker_mb_large"] > 0
    assert 0.05 * 80000 < figures["dedup_duplicates_large"] < 0.15 * 80000  # the share of copies, 10 % by default
