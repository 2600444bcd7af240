"""``vip bench render``: the stage's rate beside the bare render loop's, from one run."""

from __future__ import annotations

import json

import pytest

from tasks.cli import main


def test_vip_bench_render_reports_both_rates(capsys, monkeypatch):
    monkeypatch.setenv("MESA_SHADER_CACHE_DISABLE", "false")  # restored after the test: the bench turns it off
    code = main(["bench", "render", "--json", "--sizes", "32", "--num-images", "8", "--images-per-program", "4",
                 "--repeats", "1"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    row = result["sizes"]["32"]
    assert row["bare_images_per_s"] > 0 and row["stage_images_per_s"] > 0
    assert row["stage_over_bare"] == pytest.approx(row["stage_images_per_s"] / row["bare_images_per_s"], rel=0.01)
    assert result["device"] and result["meets_target"] == (row["stage_over_bare"] >= 0.7)
