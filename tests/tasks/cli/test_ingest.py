"""``vip ingest``: a missing or malformed url list, a bad condition or evaluation folder is one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tasks.fixtures.web import laion_row, write_url_list


ROOT = Path(__file__).resolve().parents[3]

VIP = [sys.executable, "-m", "tasks.cli"]


def test_missing_or_malformed_url_lists_are_one_line_errors(tmp_path):
    garbage = tmp_path / "broken.parquet"
    garbage.write_bytes(b"PAR1 but not really")
    for url_list, message in [(tmp_path / "missing.parquet", "does not exist"), (garbage, "is not valid parquet")]:
        result = subprocess.run(
            VIP + ["ingest", "--url-list", str(url_list), "--output", str(tmp_path / "out")],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 2
        assert result.stderr.startswith("vip ingest: error: url list") and message in result.stderr
        assert result.stderr.count("\n") == 1 and result.stdout == ""


def test_bad_conditions_and_evaluation_folders_are_one_line_errors(tmp_path):
    url_list = write_url_list(tmp_path / "laion.csv", [laion_row("http://127.0.0.1:9/a.jpg", "a")])
    base = VIP + ["ingest", "--url-list", str(url_list), "--output", str(tmp_path / "out")]
    for extra, message in [
        (["--condition", "aesthetic > 5"], "names column 'aesthetic'"),
        (["--condition", "similarity is high"], "is not of the form"),
        (["--eval-images", str(tmp_path / "nowhere")], "evaluation image folder"),
        (["--eval-data", str(tmp_path / "nowhere")], "evaluation image folder"),  # the name vip shards and make use
    ]:
        result = subprocess.run(base + extra, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2
        assert result.stderr.startswith("vip ingest: error: ") and message in result.stderr
        assert result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()
