"""The recipe levers of the pre-training stages and the privacy rules each keeps: augmentation multiplicity (K views
averaged inside one image's loss: one clipped contribution per image), trainable position embeddings (clipped like
every parameter); and the defaults, which take exactly the steps a run without the levers takes. The moving average
of the weights is tested on the runs of test_pretrain.py."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.stages.pretrain import build_worker_run
from tests.core.privacy.test_dp_rules import (  # noqa: F401 (fixture)
    one_at_a_time_clipped_sum, shards, tiny_config, worker_loop_config,
)
from tests.tasks.stages.test_pretrain_augmentation import synthetic_loop_config
from vip_core.config import PRESETS, get_preset, validate_config, with_overrides
from vip_core.privacy.engine import plan_model, privatized_gradients
from vip_core.train.augment import apply_crop_flips, draw_crop_flips
from vip_core.train.data import normalise

VIEWS = 3
CLIP = 1e-3
MANY_VIEWS = {"private.augmentation": "rrc_flip", "private.augmentation_multiplicity": VIEWS, "private.batch_size": 8}
POSITION_EMBEDDINGS = ("pos_embed", "decoder_pos_embed")


def first_inputs(loop_config: dict, least: int = 3):
    """A worker run of ``loop_config`` and the first ``least`` samples' inputs of the first step with at least that
    many; the run's step then samples without decoding (a step given ``lambda local, stream: inputs`` steps on them)."""
    for _ in range(20):
        run = build_worker_run(loop_config, 0, 1)
        try:
            local = run.pipeline.sample()
            inputs = run.batch(local, run.step.streams.sample)
        finally:
            run.pipeline.close()
        run.step.sampler = run.pipeline.sampler
        if len(local) >= least:
            return run, tuple(tensor[:least] for tensor in inputs)
    raise AssertionError("no sample of the wanted size in 20 draws")


def clipped_sums(run, inputs):
    """``clipped_sum(indices)``: the engine's clipped sum (no noise, not divided) of those samples, flat, float64."""

    def clipped_sum(indices: list[int]) -> torch.Tensor:
        chosen = tuple(tensor[indices] for tensor in inputs)
        privatized_gradients(run.model, run.loss, chosen, max_grad_norm=CLIP, noise_multiplier=0.0,
                             expected_batch_size=1.0, physical_batch_size=2)
        return torch.cat([p.grad.reshape(-1).double() for p in run.model.parameters() if p.requires_grad])

    return clipped_sum


def assert_leave_one_out_within_c(run, inputs) -> torch.Tensor:
    """Every sample's clipped contribution, and what removing it moves the clipped sum by, are at most C; the sum
    is the one-sample-at-a-time reference's. Returns the sum of everyone."""
    clipped_sum, size = clipped_sums(run, inputs), len(inputs[0])
    everyone = clipped_sum(list(range(size)))
    reference = one_at_a_time_clipped_sum(run.model, run.loss, inputs, CLIP)
    assert torch.allclose(everyone, reference, rtol=1e-4, atol=CLIP * 1e-4)
    for left_out in range(size):
        alone = clipped_sum([left_out])
        neighbour = clipped_sum([i for i in range(size) if i != left_out])
        assert float(alone.norm()) <= CLIP * (1 + 1e-4), f"sample {left_out} alone"
        assert float((everyone - neighbour).norm()) <= CLIP * (1 + 1e-4), f"without sample {left_out}"
    return everyone


def kept_patches(noise: torch.Tensor, mask_ratio: float) -> frozenset[int]:
    """The patches a row of masking noise ``[L]`` keeps (the lowest ``int(L * (1 - ratio))``)."""
    return frozenset(torch.argsort(noise)[:int(len(noise) * (1 - mask_ratio))].tolist())


# ------------------------------------------------------------------------------------------------ multiplicity


def test_k_views_keep_every_samples_clipped_contribution_within_c(shards):  # noqa: F811
    run, inputs = first_inputs(worker_loop_config(tiny_config(**MANY_VIEWS), shards))
    pixels, noise, crops = inputs
    assert noise.shape == (len(pixels), VIEWS * run.model.num_patches) and crops.shape == (len(pixels), VIEWS * 5)
    forwards = []
    run.model.register_forward_hook(lambda module, args, output: forwards.append(len(args[0])))
    assert_leave_one_out_within_c(run, inputs)
    assert forwards[:VIEWS] == [2] * VIEWS  # each microbatch of 2 images runs the model once per view, on its 2 rows


def test_with_k_views_a_samples_loss_depends_on_that_samples_pixels_and_draws_only(shards):  # noqa: F811
    run, inputs = first_inputs(worker_loop_config(tiny_config(**MANY_VIEWS), shards))
    pixels, noise, crops = inputs
    with torch.no_grad():
        losses = run.loss(run.model, inputs)  # [k]
        other_pixels = pixels.clone()
        other_pixels[1] = 255 - other_pixels[1]
        other_view = noise.clone()
        other_view[1, -run.model.num_patches:] = torch.rand(run.model.num_patches)  # sample 1's last view
        moved = [run.loss(run.model, (other_pixels, noise, crops)), run.loss(run.model, (pixels, other_view, crops))]
    others = [i for i in range(len(pixels)) if i != 1]
    for changed in moved:
        assert torch.equal(changed[others], losses[others])
        assert not torch.isclose(changed[1], losses[1])


def test_k_views_are_k_distinct_masks_and_crops_per_sample_the_same_for_one_seed(shards):  # noqa: F811
    loop_config = synthetic_loop_config(shards)
    config = with_overrides(validate_config(loop_config["config"]), {"synthetic.augmentation_multiplicity": VIEWS})
    loop_config["config"] = config.model_dump(mode="json")
    run, inputs = first_inputs(loop_config)
    _, same = first_inputs(loop_config)
    assert all(torch.equal(a, b) for a, b in zip(inputs, same))
    pixels, noise, crops = inputs
    ratio = run.model.mask_ratio
    for row, boxes in zip(noise.unflatten(1, (VIEWS, -1)), crops.unflatten(1, (VIEWS, -1))):  # [K, L], [K, 5]
        assert len({kept_patches(view, ratio) for view in row}) == VIEWS
        assert len({tuple(box.tolist()) for box in boxes}) == VIEWS


def test_one_view_is_exactly_the_loss_and_the_draws_of_a_run_without_views(shards):  # noqa: F811
    config = tiny_config(**{**MANY_VIEWS, "private.augmentation_multiplicity": 1})
    run, inputs = first_inputs(worker_loop_config(config, shards))
    pixels, noise, crops = inputs
    assert noise.shape == (len(pixels), run.model.num_patches) and crops.shape == (len(pixels), 5)
    with torch.no_grad():
        expected = run.model(normalise(apply_crop_flips(pixels.float(), crops)), noise=noise)[0]  # [k]
        assert torch.equal(run.loss(run.model, inputs), expected)


def _todays_steps(loop_config: dict, monkeypatch, steps: int = 2) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` steps of a worker of ``loop_config`` through batch and loss functions written as
    they were before the levers: one mask row [k, L] and one crop row [k, 5] per sample, one forward."""
    monkeypatch.setattr("vip_core.train.step.private_entropy", lambda: 2**100 + 7)  # two private runs alike
    run = build_worker_run(loop_config, 0, 1)
    training = run.training

    def batch(local, stream):
        draws = (stream.uniform((len(local), run.model.num_patches)),
                 draw_crop_flips(stream, len(local), scale=training.crop_scale, ratio=training.crop_ratio))
        return (run.pipeline.pixels(local).pixels, *draws)

    def loss(model, inputs):
        pixels, noise, crops = inputs
        return model(normalise(apply_crop_flips(pixels.float(), crops)), noise=noise)[0].float()  # [b]

    try:
        for _ in range(steps):
            run.step(batch, loss)
    finally:
        run.pipeline.close()
    return run.model.state_dict()


def _default_steps(loop_config: dict, monkeypatch, steps: int = 2) -> dict[str, torch.Tensor]:
    monkeypatch.setattr("vip_core.train.step.private_entropy", lambda: 2**100 + 7)
    run = build_worker_run(loop_config, 0, 1)
    try:
        for _ in range(steps):
            run.step(run.batch, run.loss)
            run.average_weights()
    finally:
        run.pipeline.close()
    assert run.ema is None
    return run.model.state_dict()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_leaves_the_levers_off(name):
    config = get_preset(name)
    for training in (config.synthetic, config.private):
        assert (training.augmentation_multiplicity, training.ema_decay, training.train_pos_embed) == (1, 0.0, False)
    assert config.evaluation.encoder_weights == "final"


@pytest.mark.parametrize("stage", ["private", "synthetic"])
def test_the_defaults_take_bit_for_bit_the_steps_of_a_run_without_levers(shards, monkeypatch, stage):  # noqa: F811
    if stage == "private":
        loop_config = worker_loop_config(tiny_config(**{"private.augmentation": "rrc_flip"}), shards)
    else:
        loop_config = synthetic_loop_config(shards)
    today, default = _todays_steps(loop_config, monkeypatch), _default_steps(loop_config, monkeypatch)
    assert all(torch.equal(today[name], default[name]) for name in today)


# ------------------------------------------------------------------------------------------------ position embeddings


def test_trained_position_embeddings_are_clipped_with_every_parameter_and_move(shards):  # noqa: F811
    run, inputs = first_inputs(worker_loop_config(tiny_config(**{"private.train_pos_embed": True}), shards))
    assert set(POSITION_EMBEDDINGS) <= {name for name, _ in plan_model(run.model).plain}
    everyone = assert_leave_one_out_within_c(run, inputs)  # the flat sum holds both embeddings
    sections = dict(zip([name for name, _ in run.model.named_parameters()],
                        everyone.split([p.numel() for p in run.model.parameters()])))
    assert all(sections[name].norm() > 0 for name in POSITION_EMBEDDINGS)
    before = {name: getattr(run.model, name).detach().clone() for name in POSITION_EMBEDDINGS}
    run.step(lambda local, stream: inputs, run.loss)
    assert all(not torch.equal(getattr(run.model, name), before[name]) for name in POSITION_EMBEDDINGS)


def test_by_default_the_position_embeddings_are_frozen_and_stay_bit_identical(shards):  # noqa: F811
    run, inputs = first_inputs(worker_loop_config(tiny_config(), shards))
    assert not {name for name, _ in plan_model(run.model).plain} & set(POSITION_EMBEDDINGS)
    before = {name: getattr(run.model, name).detach().clone() for name in POSITION_EMBEDDINGS}
    blocks = run.model.blocks[0].attn.qkv.weight.detach().clone()
    run.step(lambda local, stream: inputs, run.loss)
    assert all(torch.equal(getattr(run.model, name), before[name]) for name in POSITION_EMBEDDINGS)
    assert not torch.equal(run.model.blocks[0].attn.qkv.weight, blocks)


def test_a_resume_with_the_position_embeddings_flipped_is_refused_naming_the_field(shards, tmp_path):  # noqa: F811
    from tasks.stages.pretrain import stage_plan
    from vip_core.train.data import measure_shards

    config = tiny_config(**{"privacy.noise_multiplier": None, "privacy.target_epsilon": 8.0})
    stage_plan(config, "private", measure_shards(shards), tmp_path, continuing=False)
    flipped = with_overrides(config, {"private.train_pos_embed": True})
    with pytest.raises(ValueError, match="resume refused: the run was planned with private.train_pos_embed=false, "
                                         "the configuration now gives true"):
        stage_plan(flipped, "private", measure_shards(shards), tmp_path, continuing=True)
    assert stage_plan(config, "private", measure_shards(shards), tmp_path, continuing=True)["train_pos_embed"] is False
    plan_file = tmp_path / "plan.json"  # a plan written before vip recorded the setting: its run is not second-guessed
    plan_file.write_text(json.dumps({k: v for k, v in json.loads(plan_file.read_text()).items() if k != "train_pos_embed"}))
    assert "train_pos_embed" not in stage_plan(flipped, "private", measure_shards(shards), tmp_path, continuing=True)
    # that resume fails at the optimiser's load; the setting the run started with is still accepted afterwards
    assert "train_pos_embed" not in stage_plan(config, "private", measure_shards(shards), tmp_path, continuing=True)
