"""The size line said before a run, and the rule that asks before a run far beyond a CPU demo without a GPU."""

from __future__ import annotations

import pytest

from tasks.runtime.sizing import MEASURED, Devices, confirm, size_run, url_list_rows
from vip_core.config import PRESETS, get_preset

PIPELINE = ("ingest", "render", "pretrain-syn", "pretrain-dp")
CPU_HERE, ONE_GPU = Devices(cores=2, gpus=0), Devices(cores=16, gpus=1)


def test_the_cpu_presets_start_at_once_and_every_paper_preset_asks_on_a_machine_without_a_gpu():
    asks = {name for name in PRESETS
            if size_run(get_preset(name), PIPELINE, ingest_rows=320, devices=CPU_HERE).needs_confirmation()}
    assert asks == set(PRESETS) - {"tiny", "vip-pico"}
    assert not any(size_run(get_preset(name), PIPELINE, ingest_rows=320, devices=ONE_GPU).needs_confirmation()
                   for name in PRESETS)


def test_the_size_line_names_the_images_the_steps_and_the_time_expected_here():
    line = size_run(get_preset("vip-base"), PIPELINE, ingest_rows=1_000, devices=CPU_HERE).line()
    for part in ("render 1,050,000 images at 256 px", "ingest 1,000 url-list rows", "pretrain-dp 6,000 steps of 98,304",
                 "pretrain-syn 10,000 steps of 4,096 images", "CPU, 2 cores, no GPU", "years"):
        assert part in line, (part, line)
    tiny = size_run(get_preset("tiny"), PIPELINE, ingest_rows=40, devices=CPU_HERE)
    assert tiny.seconds < 120 and "render 256 images at 32 px" in tiny.line()


def test_a_demo_run_is_sized_with_its_start_up_not_its_steps_alone():
    """`make run` of the tiny preset measured 102 s from the command to the end of pre-training (evaluation is not
    sized): the estimate counts the start-up and each training stage's workers, not only their few steps."""
    tiny = size_run(get_preset("tiny"), PIPELINE, ingest_rows=320, devices=CPU_HERE)
    assert "start-up" in tiny.line() and 0.67 * 102 <= tiny.seconds <= 1.5 * 102
    assert "evaluation" not in tiny.line()
    evaluated = size_run(get_preset("tiny"), PIPELINE, ingest_rows=320, devices=CPU_HERE, evaluation=True)
    assert ", then evaluation (not sized)" in evaluated.line() and evaluated.seconds == tiny.seconds


def test_the_paper_dp_stage_on_one_h200_takes_what_the_benchmark_measured():
    """589,824,000 DP images at the measured 1,240 images/s of ViP-Base on one H200 (docs/scaling.md)."""
    size = size_run(get_preset("vip-base"), ("pretrain-dp",), ingest_rows=None, devices=ONE_GPU)
    measured_s = 6_000 * 98_304 / MEASURED["cuda"]["dp_images_per_s_vip_base"]
    assert size.seconds == pytest.approx(measured_s, rel=0.01)
    eight = size_run(get_preset("vip-base"), ("pretrain-dp",), ingest_rows=None, devices=Devices(cores=64, gpus=8))
    assert eight.seconds == pytest.approx(size.seconds / 8, rel=0.01)


def test_a_finished_stage_is_done_and_costs_nothing():
    size = size_run(get_preset("vip-base"), PIPELINE, ingest_rows=None, done={"render", "pretrain-syn"},
                    devices=CPU_HERE)
    assert "render done" in size.line() and "pretrain-syn done" in size.line()
    assert size.seconds == size_run(get_preset("vip-base"), ("pretrain-dp",), ingest_rows=None,
                                    devices=CPU_HERE).seconds


def test_a_url_list_is_counted_from_its_file(tmp_path):
    from tasks.fixtures.web import laion_row, write_url_list

    rows = [laion_row(f"http://127.0.0.1/{i}.jpg", "photo") for i in range(7)]
    assert url_list_rows(str(write_url_list(tmp_path / "urls.parquet", rows))) == 7
    assert url_list_rows(str(write_url_list(tmp_path / "urls.csv", rows))) == 7
    assert url_list_rows(str(tmp_path / "missing.parquet")) is None


def test_a_run_that_asks_starts_with_yes_and_stops_in_one_line_without_a_terminal(monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    paper = size_run(get_preset("vip-nano"), PIPELINE, ingest_rows=None, devices=CPU_HERE)
    refusal = confirm(paper, yes=False, flag="--yes")
    assert refusal is not None and "--yes" in refusal and "\n" not in refusal and "no GPU" in refusal
    assert confirm(paper, yes=True, flag="--yes") is None
    assert confirm(size_run(get_preset("tiny"), PIPELINE, ingest_rows=40, devices=CPU_HERE), yes=False,
                   flag="--yes") is None
