"""``vip bench gpu-check``, as a dry run on the CPU at small shapes: the gpu tests are run (and skipped here, with no
CUDA device), each batch size gets one row with the DP step against the non-private one, the strict mode and opacus
where asked, and the table says whether the row met the targets. No timing is asserted."""

from __future__ import annotations

import json

from tasks.benchmarks.gpu_check import TARGET_PEAK_MEM_RATIO, TARGET_RATIO, table
from tasks.cli import main


def test_gpu_check_runs_the_gpu_tests_then_one_benchmark_row_per_batch_size(capsys):
    code = main(["bench", "gpu-check", "--json", "--device", "cpu", "--preset", "tiny", "--img-size", "32",
                 "--batches", "4", "8", "--opacus-batches", "4", "--repeats", "1", "--warmup", "0"])
    assert code == 0
    check = json.loads(capsys.readouterr().out)
    assert check["tests"]["passed"] and "deselected" in check["tests"]["line"], check["tests"]
    assert [row["batch"] for row in check["rows"]] == [4, 8]
    with_opacus, without = check["rows"]
    assert with_opacus["opacus_ghost_ratio"] > 0 and "opacus_hooks_ratio" not in with_opacus  # not a target
    assert without["opacus_ghost_ratio"] is None and without["dp_strict_ratio"] > 0
    for row in check["rows"]:
        assert row["dp_ratio"] == row["dp_s"] / row["nonprivate_s"] and row["dp_images_per_s"] > 0
        met = (row["dp_ratio"] <= TARGET_RATIO and row["dp_peak_mem_ratio"] <= TARGET_PEAK_MEM_RATIO
               and (row["opacus_ghost_ratio"] is None or row["dp_ratio"] < row["opacus_ghost_ratio"]))
        assert row["meets_target"] is met

    lines = table(check)
    assert lines[1].startswith("gpu tests: passed") and len(lines) == 5 + 2
    assert lines[-2].startswith("| 4 | ") and lines[-1].startswith("| 8 | ")
    assert all(line.endswith(("| yes |", "| no |")) for line in lines[-2:])
