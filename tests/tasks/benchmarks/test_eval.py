"""``vip bench eval`` smoke test: the probe's peak memory at both sizes and the input pipeline's images/s beside the
encoder alone, as JSON and as printed lines. No figure is asserted against a target: they are for people to read."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.cli import main

ARGS = ["bench", "eval", "--preset", "tiny", "--img-size", "32", "--sizes", "160", "40", "--val-images", "20",
        "--classes", "4", "--batch", "16", "--source-side", "48", "--epochs", "1"]


def test_bench_eval_prints_both_sizes_and_the_input_ratio_as_json(capsys):
    assert main([*ARGS, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["images_small"], result["images_large"]) == (40, 160)
    for key in ("peak_rss_mb_small", "peak_rss_mb_large", "extract_images_per_s", "encoder_images_per_s",
                "input_ratio", "probe_images_per_s"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["input_ratio"] == pytest.approx(result["extract_images_per_s"] / result["encoder_images_per_s"],
                                                  rel=0.01)
    assert result["rss_growth_mb"] == pytest.approx(result["peak_rss_mb_large"] - result["peak_rss_mb_small"], abs=0.1)
    assert result["features"] == 2 * 64  # every block of the tiny encoder, pooled: the paper's protocol
    assert (result["target_rss_growth_mb"], result["target_input_ratio"]) == (100.0, 0.9)


def test_bench_eval_refuses_a_size_too_small_for_its_classes(capsys):
    assert main(["bench", "eval", "--sizes", "3", "40", "--classes", "4"]) == 2
    assert "--sizes: 3 images cannot fill 4 classes" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_eval_on_cuda_in_bf16(capsys):
    assert main([*ARGS, "--json", "--device", "cuda", "--precision", "bf16"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"] == "cuda" and result["encoder_images_per_s"] > 0 and result["extract_images_per_s"] > 0
