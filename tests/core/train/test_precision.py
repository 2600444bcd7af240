"""The stage's ``precision`` drives autocast in the pre-training worker (and fine-tuning): bf16 matmuls in
the forward, float32 gradients from the engine; on CUDA too when there is one."""

from __future__ import annotations

import pytest
import torch

from tasks.stages.pretrain import build_worker_run
from tests.core.privacy.test_dp_rules import shards, tiny_config, worker_loop_config  # noqa: F401 (fixture)
from vip_core.train.precision import autocast


def _step_dtypes(loop_config: dict) -> tuple[set, set]:
    """The dtypes of the first encoder block's qkv output and of the privatized gradients, on a non-empty step."""
    for _ in range(20):
        run = build_worker_run(loop_config, 0, 1)
        if torch.cuda.is_available() and run.training.use_gpu:
            assert next(run.model.parameters()).is_cuda
        outputs, grads = set(), set()
        run.model.blocks[0].attn.qkv.register_forward_hook(lambda module, args, out: outputs.add(out.dtype))
        run.step(run.batch, run.loss, observe=lambda model: grads.update(
            p.grad.dtype for p in model.parameters() if p.grad is not None))
        run.pipeline.close()
        if outputs:
            return outputs, grads
    raise AssertionError("20 empty Poisson samples in a row")


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_stage_precision_drives_autocast_and_the_gradients_stay_float32(shards, precision, dtype):  # noqa: F811
    outputs, grads = _step_dtypes(worker_loop_config(tiny_config(**{"private.precision": precision}), shards))
    assert outputs == {dtype} and grads == {torch.float32}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_on_cuda_runs_the_private_step_in_bf16_with_float32_gradients(shards):  # noqa: F811
    config = tiny_config(**{"private.precision": "bf16", "private.use_gpu": True})
    outputs, grads = _step_dtypes(worker_loop_config(config, shards))
    assert outputs == {torch.bfloat16} and grads == {torch.float32}


def test_an_unknown_precision_is_a_clear_error():
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16"):
        autocast("fp16", "cpu")
