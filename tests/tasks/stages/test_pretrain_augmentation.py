"""The pre-training worker's augmentation (``augmentation: rrc_flip``): each sample's crop and flip come from the
step's per-sample stream, fresh in every private step and run, the same in two synthetic runs of one seed;
``none`` hands the step the images and masks as before."""

from __future__ import annotations

import torch

from tasks.stages.pretrain import build_worker_run
from tests.core.privacy.test_dp_rules import shards, tiny_config, worker_loop_config  # noqa: F401 (fixture)
from vip_core.config import with_overrides
from vip_core.train.augment import apply_crop_flips
from vip_core.train.data import measure_shards, normalise
from vip_core.train.pipeline import mae_loss

AUGMENTED = {"private.augmentation": "rrc_flip", "private.batch_size": 8}


def synthetic_loop_config(shards_folder) -> dict:
    """What the driver hands a worker of the synthetic stage (no privacy, streams keyed by the config seed)."""
    config = with_overrides(tiny_config(), {"synthetic.augmentation": "rrc_flip", "synthetic.batch_size": 8,
                                            "synthetic.physical_batch_size": 4})
    data = measure_shards(shards_folder)
    plan = {"private": False, "run": "test", "dataset_size": sum(data.counts), "fingerprint": data.fingerprint,
            "sample_rate": 8 / sum(data.counts)}
    return {"config": config.model_dump(mode="json"), "stage": "synthetic", "shards": [str(s) for s in data.shards],
            "counts": data.counts, "plan": plan, "init_checkpoint": None}


def step_inputs(loop_config: dict, steps: int = 2) -> list[tuple[torch.Tensor, ...]]:
    """The inputs the worker's batch hands its first ``steps`` steps."""
    run = build_worker_run(loop_config, 0, 1)
    seen = []
    try:
        for _ in range(steps):
            run.step(lambda local, stream: seen.append(run.batch(local, stream)) or seen[-1], run.loss)
    finally:
        run.pipeline.close()
    return seen


def crop_rows(inputs: list[tuple[torch.Tensor, ...]]) -> list[tuple[float, ...]]:
    return [tuple(row.tolist()) for pixels, noise, crops in inputs for row in crops]


def test_a_private_samples_crop_and_flip_are_fresh_in_every_step_and_every_run(shards):  # noqa: F811
    loop_config = worker_loop_config(tiny_config(**AUGMENTED), shards)
    first, second = step_inputs(loop_config), step_inputs(loop_config)
    assert all(len(inputs) == 3 and inputs[2].shape == (len(inputs[0]), 5) for inputs in first + second)
    rows_first, rows_second = crop_rows(first), crop_rows(second)
    assert len(set(rows_first)) == len(rows_first)  # no two samples, of one step or of two, share a crop
    assert not set(rows_first) & set(rows_second)  # nor two runs of one config
    image = first[0][0][:1].expand(2, -1, -1, -1).float()  # one image, under two draws
    crops = torch.stack([first[0][2][0], second[0][2][0]])
    augmented = apply_crop_flips(image, crops)
    assert not torch.equal(augmented[0], augmented[1])


def test_two_synthetic_runs_of_one_seed_crop_and_flip_alike(shards):  # noqa: F811
    first, second = step_inputs(synthetic_loop_config(shards)), step_inputs(synthetic_loop_config(shards))
    for one, other in zip(first, second):
        assert all(torch.equal(a, b) for a, b in zip(one, other))
    assert len(set(crop_rows(first))) == len(crop_rows(first)) > 0


def test_without_augmentation_the_step_gets_the_images_and_masks_and_the_loss_is_the_plain_mae_loss(shards):  # noqa: F811
    run = build_worker_run(worker_loop_config(tiny_config(), shards), 0, 1)
    try:
        local = run.pipeline.sample()
        inputs = run.batch(local, run.step.streams.sample)
    finally:
        run.pipeline.close()
    assert len(inputs) == 2
    pixels, noise = inputs  # [k, 3, H, W] uint8, [k, L]
    assert pixels.dtype == torch.uint8 and noise.shape == (len(local), run.model.num_patches)
    if len(local):
        expected = run.model(normalise(pixels), noise=noise)[0]  # [k]
        assert torch.allclose(run.loss(run.model, inputs), expected)
        assert torch.allclose(mae_loss(run.model, pixels, noise, "fp32"), expected)
