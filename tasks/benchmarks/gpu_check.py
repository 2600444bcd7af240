"""``vip bench gpu-check``: what a GPU machine must show before the DP step's figures count, in one command and one
table: the ``gpu``-marked tests (the leave-one-out bound and the tensor-core probe on the device among them), then
``vip bench dp-step`` of ViP-Base at 224 px under bf16 at each batch size, with the strict IEEE float32 mode and
opacus's ghost clipping in the same runs, against the targets. Opacus's per-sample hooks are left out: the targets
do not name them, and at these batch sizes they hold every sample's gradient (about ×4.7 the non-private step's
memory)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = ("tests/core/privacy", "tests/tasks/benchmarks")
TESTS_TIMEOUT_S = 300
TARGET_RATIO = 1.3  # the DP step against the non-private step of the same run, at each batch size
TARGET_PEAK_MEM_RATIO = 1.2


def gpu_check(*, device: str = "cuda", preset: str = "vip-base", img_size: int = 224,
              batches: tuple[int, ...] = (256, 512), opacus_batches: tuple[int, ...] = (256, 512),
              repeats: int = 5, warmup: int = 2, tests: bool = True) -> dict[str, Any]:
    """Runs the ``gpu`` tests (when ``tests``) and the DP-step benchmark at each of ``batches`` (opacus's ghost
    clipping too at ``opacus_batches``); returns the tests' summary line and one row per batch size."""
    from tasks.benchmarks.dp_step import bench_dp_step

    summary = run_gpu_tests() if tests else None
    rows = []
    for index, batch in enumerate(batches):
        result = bench_dp_step(preset=preset, img_size=img_size, batch=batch, repeats=repeats, warmup=warmup,
                               threads=0, opacus=batch in opacus_batches, seed=0, precision="bf16", device=device,
                               secure=False, strict=True, opacus_hooks=False, reference=index == 0)
        rows.append(check_row(batch, result))
    return {"device": rows[0]["device"] if rows else device, "preset": preset, "img_size": img_size,
            "tests": summary, "rows": rows}


def run_gpu_tests() -> dict[str, Any]:
    """``pytest -m gpu`` on the privacy and benchmark tests: its exit status and last line."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", *GPU_TESTS]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"passed": False, "line": f"pytest -m gpu ran past {TESTS_TIMEOUT_S} s"}
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"passed": done.returncode == 0, "line": lines[-1] if lines else f"exit status {done.returncode}"}


def check_row(batch: int, result: dict[str, Any]) -> dict[str, Any]:
    """One batch size's figures from a ``bench_dp_step`` result, and whether they meet the targets: the DP step
    within :data:`TARGET_RATIO` of the non-private one, its memory within :data:`TARGET_PEAK_MEM_RATIO`, and ahead
    of opacus's ghost clipping where that ran."""
    ghost = result.get("opacus_ghost_ratio")
    kernels = result.get("kernels_s", {}).get("dp", {}).get("by_precision", {})
    meets = (result["dp_ratio"] <= TARGET_RATIO and result["dp_peak_mem_ratio"] <= TARGET_PEAK_MEM_RATIO
             and (ghost is None or result["dp_ratio"] < ghost))
    return {
        "batch": batch, "device": result["device"],
        "nonprivate_s": result["nonprivate_s"], "dp_s": result["dp_s"],
        "dp_images_per_s": batch / result["dp_s"], "dp_ratio": result["dp_ratio"],
        "dp_ratio_min": result["dp_ratio_min"], "dp_ratio_max": result["dp_ratio_max"],
        "dp_strict_ratio": result.get("dp_strict_ratio"), "opacus_ghost_ratio": ghost,
        "dp_peak_mem_ratio": result["dp_peak_mem_ratio"],
        "dp_host_ops_ratio": result["dp_host_ops_ratio"], "clip_shortfall": result["clip_shortfall"],
        "dp_kernel_s_by_precision": kernels, "meets_target": meets,
    }


def table(check: dict[str, Any]) -> list[str]:
    """The check as lines for a terminal: the tests' line, then one table row per batch size."""
    def ratio(value: float | None) -> str:
        return "" if value is None else f"x{value:.2f}"

    tests = check["tests"]
    lines = [f"device: {check['device']}; {check['preset']} at {check['img_size']} px, bf16",
             "gpu tests: " + ("not run" if tests is None else f"{'passed' if tests['passed'] else 'FAILED'}: "
                                                               f"{tests['line']}"),
             f"targets: DP <= x{TARGET_RATIO} the non-private step, memory <= x{TARGET_PEAK_MEM_RATIO}, "
             "ahead of opacus ghost",
             "| B | non-private s | DP s (img/s) | DP x (rounds) | strict x | opacus ghost x | "
             "memory x | host ops x | clip shortfall | DP kernels: matmul bf16 / fp32 / other s | meets |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in check["rows"]:
        kernels = row["dp_kernel_s_by_precision"]
        split = " / ".join(f"{kernels.get(kind, 0.0):.4f}" for kind in ("matmul_bf16", "matmul_fp32", "other"))
        lines.append(
            f"| {row['batch']} | {row['nonprivate_s']:.4f} | {row['dp_s']:.4f} ({row['dp_images_per_s']:,.0f}) | "
            f"x{row['dp_ratio']:.2f} ({row['dp_ratio_min']:.2f}-{row['dp_ratio_max']:.2f}) | "
            f"{ratio(row['dp_strict_ratio'])} | {ratio(row['opacus_ghost_ratio'])} | "
            f"x{row['dp_peak_mem_ratio']:.3f} | x{row['dp_host_ops_ratio']:.2f} | "
            f"{row['clip_shortfall']:.4f} | {split if kernels else ''} | {'yes' if row['meets_target'] else 'no'} |")
    return lines
