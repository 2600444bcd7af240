"""``vip bench train`` smoke test: the figures are there, as JSON and as printed lines. No timing is asserted:
the figures are for people to read."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.cli import main
from vip_core.train.pipeline import DECODE_MODE

ARGS = ["bench", "train", "--images", "48", "--batch", "8", "--source-side", "64", "--steps", "1", "--rounds", "2",
        "--warmup", "0"]


def test_bench_train_prints_the_figures_as_json(capsys):
    assert main([*ARGS, "--json", "--precision", "bf16"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("step_images_per_s", "in_memory_images_per_s", "input_ratio", "loader_images_per_s_per_proc"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["precision"] == "bf16" and result["target_input_ratio"] == 0.95
    rounds = result["input_ratio_per_round"]  # the spread: each round's own ratio
    assert len(rounds) == 2 and all(r > 0 for r in rounds)
    assert (result["input_ratio_min"], result["input_ratio_max"]) == (min(rounds), max(rounds))
    assert result["decode_mode"] == DECODE_MODE and result["decode_workers"] == 2  # the pre-training worker's


def test_bench_train_prints_its_figures_beside_the_in_memory_baseline(capsys):
    assert main([*ARGS, "--decode-mode", "threads", "--decode-workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "from memory" in out and "input_ratio" in out and "loader alone" in out and "1 decoding threads" in out
    assert "rounds " in out and " to " in out


def test_a_batch_larger_than_the_images_is_a_clear_error(capsys):
    assert main(["bench", "train", "--images", "4", "--batch", "8"]) == 2
    assert "--batch 8 exceeds the 4 images" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_train_on_cuda_trains_both_sides_on_the_gpu(capsys):
    assert main([*ARGS, "--json", "--device", "cuda", "--precision", "bf16"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"] == "cuda" and result["step_images_per_s"] > 0 and result["in_memory_images_per_s"] > 0
