"""The results of a pipeline run: each evaluation beside its baseline, namespaced metrics."""

from __future__ import annotations

from tasks.runtime import results
from vip_core.config import tiny


def _summary():
    return results.summarize(
        config=tiny(), flow_run_id="f", mlflow_run_id="m", workdir="/w",
        ingest={"kept": 300}, render={"images": 256}, pretrain_syn={"checkpoint": "/s", "steps": 20},
        pretrain_dp={"checkpoint": "/p", "steps": 10, "epsilon": 7.91, "delta": 0.0016},
        evaluations={"linprobe": {"result": {"top1": 0.62}, "baseline": {"top1": 0.41}, "seconds": {"result": 9}}},
        registered_model="vip-encoder/3",
        audit={"epsilon_lower_bound": 0.42, "epsilon_claimed": 7.9973, "canaries": 1000, "correct_guesses": 90,
               "guesses": 100, "output": "/a"},
    )


def test_the_results_table_puts_each_evaluation_beside_its_baseline():
    table = results.text_table(_summary())
    assert "ε = 7.910 spent of target 8" in table
    row = next(line for line in table.splitlines() if line.strip().startswith("linprobe"))
    assert row.split() == ["linprobe", "top1", "0.6200", "0.4100", "+0.2100", "-"]
    assert "vip-encoder/3" in table
    assert "  audit: empirical ε ≥ 0.420 from 1000 canaries" in table
    assert "show that the stages run, not what pre-training gives" in table
    assert "Show that the stages run" not in results.markdown_table(_summary())
    assert "show that the stages run" in results.markdown_table(_summary())


def test_the_audit_line_prints_the_claimed_epsilon_as_computed_once_labelled():
    for table in (results.text_table(_summary()), results.markdown_table(_summary())):
        assert "accountant claims 7.997)" in table
        assert table.lower().count("audit:") == 1


def test_the_markdown_table_has_the_difference_column():
    table = results.markdown_table(_summary())
    assert "| evaluation | metric | ViP | random init | difference | paper ViP-Base |" in table
    assert "| linprobe | top1 | 0.6200 | 0.4100 | +0.2100 | - |" in table


def test_a_pair_the_paper_reports_shows_its_figure_and_one_without_a_baseline_shows_none():
    evaluations = {"linprobe-imagenet": {"result": {"top1": 0.5}, "baseline": None},
                   "linprobe-places365": {"result": {"top1": 0.3}, "baseline": None}}
    table = results.evaluation_table(evaluations)
    assert [line.split() for line in table[2:4]] == [["linprobe-imagenet", "top1", "0.5000", "-", "-", "0.5570"],
                                                     ["linprobe-places365", "top1", "0.3000", "-", "-", "-"]]


def test_summary_metrics_are_namespaced():
    metrics = results.summary_metrics(_summary())
    assert metrics["privacy/epsilon"] == 7.91
    assert metrics["eval/linprobe/top1"] == 0.62
    assert metrics["eval/linprobe/top1_random_init"] == 0.41


def test_a_stage_result_reads_in_one_line():
    line = results.one_line({"images": 256, "resumed_shards": 0, "images_per_s": 13.71, "skipped": {"constant": 2},
                             "output": "/runs/tiny/render-97b39d68"})
    assert line == "images 256, resumed_shards 0, images_per_s 13.71; /runs/tiny/render-97b39d68"
