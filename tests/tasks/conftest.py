"""What the stage and command tests of evaluation share: the small public sets, a saved tiny checkpoint and
every job's metrics on it, made once per session (the jobs take a while on two cores)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.fixtures.eval_sets import make_ade20k_shapes, make_coco_shapes, make_digits_imagefolder
from tasks.stages.eval import run_evaluation
from vip_core.config import tiny
from vip_core.data.shards import ShardWriter, encode_image
from vip_core.models import build_mae, save_checkpoint

EVAL_DATA = {"linprobe": "digits", "finetune": "digits", "fewshot": "digits", "coco": "coco", "ade20k": "ade20k"}


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """``(root, config, checkpoint)``: the sets below ``root`` and an untrained tiny MAE's checkpoint."""
    root = tmp_path_factory.mktemp("evaluate")
    make_digits_imagefolder(root / "digits", img_size=32, per_class=30)
    make_coco_shapes(root / "coco", img_size=32, n=12)
    make_ade20k_shapes(root / "ade20k", img_size=32, n=12)
    config = tiny()
    torch.manual_seed(0)
    checkpoint = save_checkpoint(root / "run", model=build_mae(config.model), config=config, stage="private", step=0)
    return root, config, checkpoint


@pytest.fixture(scope="session")
def evaluations(workspace):
    """Every job's metrics on the checkpoint, written to ``root/out/<task>``."""
    root, config, checkpoint = workspace
    return {task: run_evaluation(config, task, str(checkpoint), str(root / data), str(root / "out" / task))
            for task, data in EVAL_DATA.items()}


@pytest.fixture(scope="session")
def noise_shards(tmp_path_factory):
    """``noise_shards(count)``: a folder of ``count`` random 32 px PNG images in shards of 32, made once per count."""
    made = {}

    def make(count: int):
        if count not in made:
            folder = tmp_path_factory.mktemp(f"noise-shards-{count}")
            with ShardWriter(folder, prefix="img", samples_per_shard=32) as writer:
                for i in range(count):
                    pixels = np.random.default_rng(i).integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
                    writer.write(f"{i:05d}", {"png": encode_image(Image.fromarray(pixels), "png")})
            made[count] = folder
        return made[count]

    return make
