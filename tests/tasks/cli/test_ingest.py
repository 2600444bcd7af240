"""``vip ingest``: a missing or malformed url list, a bad condition or evaluation folder is one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tasks.fixtures.web import laion_row, write_url_list


ROOT = Path(__file__).resolve().parents[3]

VIP = [sys.executable, "-m", "tasks.cli"]


def test_missing_or_malformed_url_lists_are_one_line_errors(tmp_path, vip_here):
    missing = subprocess.run(  # the program itself, once: the other cases run through its entry point here
        VIP + ["ingest", "--url-list", str(tmp_path / "missing.parquet"), "--output", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    garbage = tmp_path / "broken.parquet"
    garbage.write_bytes(b"PAR1 but not really")
    malformed = vip_here("ingest", "--url-list", str(garbage), "--output", str(tmp_path / "out"))
    for (code, out, err), message in [((missing.returncode, missing.stdout, missing.stderr), "does not exist"),
                                      (malformed, "is not valid parquet")]:
        assert code == 2
        assert err.startswith("vip ingest: error: url list") and message in err
        assert err.count("\n") == 1 and out == ""


def test_bad_conditions_and_evaluation_folders_are_one_line_errors(tmp_path, vip_here):
    url_list = write_url_list(tmp_path / "laion.csv", [laion_row("http://127.0.0.1:9/a.jpg", "a")])
    base = ["ingest", "--url-list", str(url_list), "--output", str(tmp_path / "out")]
    for extra, message in [
        (["--condition", "aesthetic > 5"], "names column 'aesthetic'"),
        (["--condition", "similarity is high"], "is not of the form"),
        (["--eval-images", str(tmp_path / "nowhere")], "evaluation image folder"),
        (["--eval-data", str(tmp_path / "nowhere")], "evaluation image folder"),  # the name vip shards and make use
    ]:
        code, _, err = vip_here(*base, *extra)
        assert code == 2
        assert err.startswith("vip ingest: error: ") and message in err
        assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()
