"""``vip bench dp-step`` smoke test: the JSON figures are there and the engine matches the naive reference.
No timing is asserted: the figures are for people to read."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.benchmarks.dp_step import opacus_mae, step_work
from tasks.cli import main
from vip_core.config import get_preset
from vip_core.models.mae import build_mae

KEYS = (
    "nonprivate_s", "dp_s", "nonprivate_cpu_s", "dp_cpu_s", "dp_ratio", "dp_peak_mem_ratio", "opacus_ghost_ratio",
    "opacus_hooks_ratio", "max_abs_err_vs_naive", "noise_ns_per_coordinate_one_thread",
    "noise_ns_per_coordinate_every_core", "dp_host_ops_ratio", "clip_shortfall",
)


def test_bench_dp_step_prints_the_figures_as_json(capsys):
    code = main(["bench", "dp-step", "--json", "--batch", "8", "--repeats", "1", "--warmup", "0", "--threads", "1"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    for key in KEYS:
        assert isinstance(result[key], float) and result[key] >= 0, key
    assert result["max_abs_err_vs_naive"] < 1e-5
    assert result["dp_ratio"] == result["dp_s"] / result["nonprivate_s"]
    for mode in ("dp", "dp_secure", "opacus_ghost", "opacus_hooks"):  # one round: its ratio is the spread
        only = round(result[f"{mode}_ratio"], 4)
        assert result[f"{mode}_ratio_per_round"] == [only] == [result[f"{mode}_ratio_min"]], mode
        assert result[f"{mode}_ratio_max"] == only, mode
    assert result["dp_cpu_ratio"] == result["dp_cpu_s"] / result["nonprivate_cpu_s"] and result["dp_cpu_s"] > 0
    assert result["cores"] >= 1 and result["noise_ns_per_coordinate_one_thread"] > 0
    assert (result["target_ratio"], result["meets_target"]) == (None, None)  # the tiny preset has no target
    work = result["work"]
    assert work["dp"]["ops"] > work["nonprivate"]["ops"] > 100
    assert result["dp_host_ops_ratio"] == work["dp"]["ops"] / work["nonprivate"]["ops"]
    assert work["nonprivate"]["matmul_gflop_fp32"] > 0 and work["nonprivate"]["matmul_gflop_bf16"] == 0  # fp32 run
    assert 0 <= result["clip_shortfall"] < 0.01


def test_bench_dp_step_says_whether_a_paper_shaped_step_met_its_targets(capsys):
    args = ["bench", "dp-step", "--json", "--preset", "vip-nano", "--img-size", "32", "--batch", "2", "--repeats",
            "1", "--warmup", "0", "--no-opacus", "--no-secure"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["target_ratio"], result["target_peak_mem_ratio"]) == (1.1, 1.05)
    met = result["dp_ratio"] <= 1.1 and result["dp_peak_mem_ratio"] <= 1.05
    assert result["meets_target"] is met


def test_bench_dp_step_times_a_logical_step_of_several_microbatches_phase_by_phase(capsys):
    code = main(["bench", "dp-step", "--json", "--batch", "4", "--microbatches", "3", "--repeats", "2", "--warmup",
                 "0", "--no-opacus"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["microbatches"] == 3 and result["batch"] == 4
    assert len(result["dp_ratio_per_round"]) == 2  # the spread of the time ratio, one figure per timed round
    assert result["dp_ratio_min"] == min(result["dp_ratio_per_round"]) > 0
    assert result["dp_ratio_max"] == max(result["dp_ratio_per_round"])
    assert set(result["phases_s"]["nonprivate"]) == {"forward", "backward", "optimizer"}
    assert set(result["phases_s"]["dp"]) == {"forward", "backward", "norms", "clipped_sum", "noise_wait", "optimizer"}
    waited = result["phases_s"]["dp"].pop("noise_wait")  # 0 when the noise was drawn before it was needed
    assert waited >= 0 and all(seconds > 0 for mode in result["phases_s"].values() for seconds in mode.values())


def test_bench_without_the_secure_mode_times_the_others_and_the_strict_mode_when_asked(capsys):
    code = main(["bench", "dp-step", "--json", "--batch", "4", "--repeats", "1", "--warmup", "0", "--no-opacus",
                 "--no-secure", "--strict-float32", "--precision", "bf16"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert "dp_secure_ratio" not in result and "opacus_ghost_ratio" not in result and result["dp_ratio"] > 0
    assert result["dp_strict_ratio"] > 0 and result["dp_strict_peak_mem_ratio"] > 0
    assert 0 <= result["clip_shortfall"] < 0.01  # bfloat16 operands: the margins scale a clipped sample a little
    work = result["work"]  # under bf16 the engine's Grams and sums are tensor-core matmuls on a GPU
    assert work["dp"]["matmul_gflop_bf16"] > work["dp"]["matmul_gflop_fp32"] > 0


def test_kernel_names_are_sorted_by_precision():
    from tasks.benchmarks.dp_step import kernel_precision

    assert kernel_precision("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul_bf16"
    assert kernel_precision("cutlass_80_tensorop_s1688gemm_128x128_16x4_tn_align4") == "matmul_tf32"
    assert kernel_precision("ampere_sgemm_128x64_tn") == "matmul_fp32"
    assert kernel_precision("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>") \
        == "other"
    # the attention of timm's blocks under bf16 (flash attention names its dtype as CUTLASS's)
    flash = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, " \
        "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t>>, false, false>"
    assert kernel_precision(flash) == "matmul_bf16"
    # cuBLAS's newer kernels name no precision: the dtypes of the operator that launched them do
    nvjet = "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNT"
    assert kernel_precision(nvjet, {"c10::BFloat16"}) == "matmul_bf16"
    assert kernel_precision(nvjet, {"float"}) == "matmul_fp32"
    assert kernel_precision(nvjet) == "matmul_fp32"


def test_a_tensor_core_product_counts_as_bfloat16_work():
    """The engine's Grams and sums on a GPU are ``bmm`` with bfloat16 operands and float32 output (``bmm.dtype``,
    which runs on CUDA and the meta device only)."""
    left, right = (torch.empty(4, 8, 16, dtype=torch.bfloat16, device="meta") for _ in range(2))
    work = step_work(lambda: torch.bmm(left, right.mT, out_dtype=torch.float32))
    assert work["matmul_gflop_bf16"] == 2 * 4 * 8 * 16 * 8 / 1e9 and work["matmul_gflop_fp32"] == 0


def test_bench_at_a_narrow_width_times_the_presets_layers_with_little_compute(capsys):
    args = ["bench", "dp-step", "--json", "--preset", "vip-base", "--img-size", "32", "--batch", "2", "--repeats", "1",
            "--warmup", "0", "--no-opacus", "--no-secure"]
    assert main([*args, "--width", "16"]) == 0
    narrow = json.loads(capsys.readouterr().out)
    assert narrow["width"] == 16 and narrow["dp_ratio"] > 0 and narrow["max_abs_err_vs_naive"] < 1e-5
    assert narrow["dp_peak_mb"] < 20  # ViP-Base's 12 + 8 blocks at width 16, not its 99 M parameters
    assert narrow["target_ratio"] is None  # not ViP-Base's shapes


def test_bench_refuses_microbatches_with_the_opacus_modes(capsys):
    assert main(["bench", "dp-step", "--json", "--microbatches", "2"]) == 2
    assert "--no-opacus" in capsys.readouterr().err


def test_bench_rejects_an_image_size_that_does_not_fit_the_patches(capsys):
    assert main(["bench", "dp-step", "--json", "--img-size", "30"]) == 2
    assert "img-size" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a CUDA device")
def test_bench_on_cuda_without_a_gpu_is_a_one_line_error(capsys):
    assert main(["bench", "dp-step", "--json", "--device", "cuda"]) == 2
    assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_dp_step_on_cuda_times_the_gpu_steps_and_names_their_kernels(capsys):
    code = main(["bench", "dp-step", "--json", "--device", "cuda", "--batch", "8", "--repeats", "1", "--warmup", "1",
                 "--precision", "bf16", "--strict-float32"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"] == torch.cuda.get_device_name() and "phases_s" not in result
    for key in KEYS:
        assert isinstance(result[key], float) and result[key] >= 0, key
    for mode in ("nonprivate", "dp"):
        kernels = result["kernels_s"][mode]["kernels"]
        assert kernels["all"] > 0 and sum(v for k, v in kernels.items() if k != "all") <= kernels["all"] + 1e-9
        assert "forward" in result["kernels_s"][mode]["ranges"]
        assert result["kernels_s"][mode]["by_precision"]["matmul_bf16"] > 0
    assert result["max_abs_err_vs_naive"] < 1e-5 and result["dp_strict_ratio"] > 0


def test_opacus_wrapper_computes_the_mae_loss():
    mae = build_mae(get_preset("tiny").model)
    imgs = torch.randn(3, 3, 32, 32)
    torch.manual_seed(5)
    expected = mae(imgs)[0]
    torch.manual_seed(5)
    assert torch.allclose(opacus_mae(mae)(imgs), expected, atol=1e-6)
