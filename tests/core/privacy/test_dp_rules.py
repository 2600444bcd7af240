"""The privacy review's checks: at least one test per differential-privacy rule of docs/privacy.md, each one
failing if its rule is broken. They drive the code paths a run uses: the plan, the one private step
(vip_core.train.step.PrivateStep) as the Ray worker builds it (tasks.stages.pretrain.build_worker_run, two real gloo
processes for rule 3), DP fine-tuning, the audit, and the published checkpoint.
"""

from __future__ import annotations

import ast
import copy
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from torch import nn
from torch.utils.data import TensorDataset

from vip_core.config import EvaluationConfig, PrivacyConfig, get_preset, with_overrides
from vip_core.data.shards import ShardWriter, encode_image
from vip_core.eval.finetune import EncoderClassifier, FinetuneSettings
from vip_core.models.checkpoint import PUBLISHED_ENTRIES, release_payload
from vip_core.models.mae import build_encoder, build_mae
from vip_core.privacy.accounting import composed_epsilon, compute_epsilon
from vip_core.privacy.engine import UnsupportedLayerError, plan_model, privatized_gradients
from vip_core.privacy.ledger import LedgerBook
from vip_core.privacy import per_sample
from vip_core.privacy.plan import PrivacyPlan, plan_privacy
from vip_core.privacy.randomness import RandomStream, inclusion_threshold
from vip_core.train.data import measure_shards, normalise
from vip_core.train.distributed import gather_objects, parameters_fingerprint
from vip_core.train.loop import run_steps
from vip_core.train.schedule import Schedule
from vip_core.train.step import PrivateStep

REPO = Path(__file__).resolve().parents[3]
SHARD_IMAGES = 11  # divides evenly among neither 2 nor 3 workers
WORLD = 2


# ------------------------------------------------------------------------------------------------ helpers


def tiny_config(**overrides):
    """The tiny preset with a constant learning rate and a generous budget."""
    base = {
        "private.batch_size": 4, "private.physical_batch_size": 2, "private.steps": 10, "private.lr": 1.0,
        "private.warmup_steps": 0, "private.schedule": "constant", "privacy.noise_multiplier": 1.0,
        "privacy.target_epsilon": 1000.0, "privacy.accountant": "rdp",
    }
    return with_overrides(get_preset("tiny"), {**base, **overrides})


def direct_plan(*, dataset_size: int, batch_size: int, sigma: float, clip: float, steps: int = 6,
                target_epsilon: float = 1e9, delta: float = 1e-3, fingerprint: str = "data") -> PrivacyPlan:
    """A plan with any σ (0 included), for tests that need the clipped sum without noise."""
    budget = PrivacyConfig(noise_multiplier=1.0, max_grad_norm=clip, target_epsilon=1e12, delta=delta,
                           accountant="rdp")
    plan = plan_privacy(budget, dataset_size=dataset_size, batch_size=batch_size, steps=steps,
                        fingerprint=fingerprint)
    return PrivacyPlan.from_dict({**plan.to_dict(), "target_epsilon": target_epsilon, "noise_multiplier": sigma})


def sgd_private_step(model: nn.Module, plan: PrivacyPlan) -> PrivateStep:
    """The private step with SGD at lr 1 in place of AdamW: the parameter change is minus the gradient."""
    step = PrivateStep(model, plan, Schedule(peak_lr=1.0, total_steps=plan.steps, kind="constant"),
                       physical_batch_size=2)
    step.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return step


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters() if p.requires_grad])


def one_at_a_time_clipped_sum(model: nn.Module, loss_fn, inputs, clip: float) -> torch.Tensor:
    """Σᵢ clip(gᵢ, C), flat, each gᵢ from its own backward pass; ``inputs`` a tensor or a tuple of tensors."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    size = len(inputs[0]) if isinstance(inputs, tuple) else len(inputs)
    for i in range(size):
        one = tuple(t[i:i + 1] for t in inputs) if isinstance(inputs, tuple) else inputs[i:i + 1]
        grads = torch.autograd.grad(loss_fn(model, one).sum(), params, allow_unused=True)
        flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double() for g, p in zip(grads, params)])
        total += flat * min(1.0, clip / (float(flat.norm()) + 1e-6))
    return total


def recording(batch):
    """``batch`` that also keeps what it handed to the step (the sampled indices and per-sample draws)."""
    seen = []

    def wrapped(local, stream):
        inputs = batch(local, stream)
        seen.append(inputs)
        return inputs

    return wrapped, seen


def privatized_gradient(step: PrivateStep, batch, loss_fn) -> torch.Tensor:
    """The flat privatized gradient a step sets, seen before its optimiser step."""
    grads = []
    step(batch, loss_fn, observe=lambda model: grads.append(
        torch.cat([p.grad.reshape(-1).double() for p in model.parameters() if p.requires_grad])))
    return grads[0]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """11 random 32 px PNG images in shards of 4, 4 and 3."""
    folder = tmp_path_factory.mktemp("private-shards")
    with ShardWriter(folder, prefix="web", samples_per_shard=4) as writer:
        for i in range(SHARD_IMAGES):
            pixels = np.random.default_rng(i).integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
            writer.write(f"{i:05d}", {"png": encode_image(Image.fromarray(pixels), "png"), "json": {"i": i}})
    return folder


def worker_loop_config(config, shards_folder: Path, **privacy_changes) -> dict:
    """What tasks.stages.pretrain's driver hands every Ray worker for the private stage of ``config``."""
    data = measure_shards(shards_folder)
    privacy = plan_privacy(config.privacy, dataset_size=sum(data.counts), batch_size=config.private.batch_size,
                           steps=config.private.steps, fingerprint=data.fingerprint)
    privacy = PrivacyPlan.from_dict({**privacy.to_dict(), **privacy_changes})
    plan = {"private": True, "run": "test", "dataset_size": privacy.dataset_size, "fingerprint": data.fingerprint,
            "sample_rate": privacy.sample_rate, "privacy": privacy.to_dict()}
    return {"config": config.model_dump(mode="json"), "stage": "private", "shards": [str(s) for s in data.shards],
            "counts": data.counts, "plan": plan, "init_checkpoint": None}


def regression_problem(n: int = 64):
    data, targets = torch.randn(n, 6), torch.randn(n, 1)

    def loss_fn(model, indices):
        return (model(data[indices]) - targets[indices]).square().sum(-1)  # [b]

    return loss_fn


# ------------------------------------------------------------------------------------------------ rule 1


def test_rule_1_the_step_samples_at_the_plans_rate_and_the_ledger_accounts_that_rate():
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0)
    step = PrivateStep(nn.Linear(2, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
    assert plan.sample_rate == 16 / 64
    assert step.sampler.sample_rate == step.ledger.sample_rate == plan.sample_rate
    assert step.sampler.dataset_size == plan.dataset_size == 64


def test_rule_1_draws_are_poisson_not_shuffled_or_fixed_size_batches():
    from vip_core.privacy.sampling import PoissonSampler

    n, q, steps = 50, 0.2, 2000
    sampler = PoissonSampler(n, q, RandomStream(0, 0, "sampling"))
    counts = torch.zeros(n)
    sizes = []
    for _ in range(steps):
        indices = sampler.sample()
        counts[indices] += 1
        sizes.append(len(indices))
    sizes = torch.tensor(sizes, dtype=torch.float64)
    # A fixed-size batch has no variance; an epoch/shuffle sampler gives every example the same count.
    assert sizes.var().item() == pytest.approx(n * q * (1 - q), rel=0.3)
    assert counts.var().item() == pytest.approx(steps * q * (1 - q), rel=0.6)
    assert abs(counts.mean().item() - steps * q) < 4 * math.sqrt(steps * q * (1 - q) / n)


def test_rule_1_the_realised_inclusion_probability_is_never_above_the_accounted_q():
    # float32 uniforms (steps of 2^-24) would include at ceil(q·2^24)/2^24: a third above q here.
    for q in (1.5 * 2.0**-24, 98_304 / 233_804_767, 0.3):
        assert 0 <= q - inclusion_threshold(q) / 2**64 < 2.0**-64


def test_rule_1_ray_workers_together_sample_every_example_at_the_accounted_rate(shards):
    from tasks.stages.pretrain import build_worker_run

    world = 3  # 11 images: blocks of 3, 4 and 4, nothing dropped
    loop_config = worker_loop_config(tiny_config(), shards)
    plan = loop_config["plan"]
    runs = [build_worker_run(loop_config, rank, world) for rank in range(world)]
    assert plan["sample_rate"] == 4 / SHARD_IMAGES and plan["dataset_size"] == SHARD_IMAGES
    covered = []
    for run in runs:
        assert run.step.sampler.sample_rate == run.step.ledger.sample_rate == plan["sample_rate"]
        assert run.step.sampler.dataset_size == len(run.partition)
        covered += range(run.partition.start, run.partition.stop)
    assert sorted(covered) == list(range(SHARD_IMAGES))
    steps = 400
    counts = torch.zeros(SHARD_IMAGES)
    for _ in range(steps):
        for run in runs:
            counts[run.partition.global_indices(run.step.sampler.sample())] += 1
    mean, sd = steps * plan["sample_rate"], math.sqrt(steps * plan["sample_rate"] * (1 - plan["sample_rate"]))
    assert ((counts - mean).abs() < 5 * sd).all(), counts.tolist()


# ------------------------------------------------------------------------------------------------ rule 2


def test_rule_2_the_step_divides_the_clipped_sum_by_the_expected_not_the_realised_size():
    loss_fn = regression_problem()
    for attempt in range(20):
        torch.manual_seed(attempt)
        model = nn.Linear(6, 1)
        reference_model = copy.deepcopy(model)
        plan = direct_plan(dataset_size=64, batch_size=16, sigma=0.0, clip=0.05)
        step = PrivateStep(model, plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
        batch, seen = recording(lambda local, stream: local)
        gradient = privatized_gradient(step, batch, loss_fn)
        if len(seen[0]) not in (0, plan.batch_size):
            break
    clipped_sum = one_at_a_time_clipped_sum(reference_model, loss_fn, seen[0], plan.max_grad_norm)
    assert torch.allclose(gradient * plan.batch_size, clipped_sum, rtol=1e-4, atol=1e-7)


def test_rule_2_ray_worker_step_divides_by_the_expected_batch_size(shards):
    from tasks.stages.pretrain import build_worker_run

    config = tiny_config()
    for attempt in range(30):
        run = build_worker_run(worker_loop_config(config, shards, noise_multiplier=0.0), 0, 1)
        reference_model = copy.deepcopy(run.model)
        batch, seen = recording(run.batch)
        gradient = privatized_gradient(run.step, batch, run.loss)
        if len(seen[0][0]) not in (0, config.private.batch_size):
            break
    pixels, noise = seen[0]  # pixels: [k, 3, H, W] uint8, noise: [k, L]

    def loss_fn(model, inputs):
        images, rows = inputs
        return model(normalise(images), noise=rows)[0]  # [b]

    clipped_sum = one_at_a_time_clipped_sum(reference_model, loss_fn, (pixels, noise), config.privacy.max_grad_norm)
    scale = float(clipped_sum.abs().max())
    assert torch.allclose(gradient * config.private.batch_size, clipped_sum, rtol=1e-3, atol=1e-5 * scale)


# ------------------------------------------------------------------------------------------------ rule 3


def _two_rank_step(rank: int, init_file: str, loop_config: dict, results: dict) -> None:
    from tasks.stages.pretrain import build_worker_run

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        run = build_worker_run(loop_config, rank, WORLD)
        sampled: list[torch.Tensor] = []
        batch, seen = recording(lambda local, stream: sampled.append(local) or run.batch(local, stream))
        gradient = privatized_gradient(run.step, batch, run.loss)
        results[rank] = {
            "gradient_std": gradient.std().item(),
            "fingerprints": gather_objects(parameters_fingerprint(run.model)),
            "block": (run.partition.start, run.partition.stop),
            "sampled": run.partition.global_indices(sampled[0]).tolist(),
            "first_mask_row": seen[0][1][0].tolist() if len(seen[0][1]) else None,
        }
    finally:
        dist.destroy_process_group()


def test_rule_3_two_workers_add_the_noise_once_and_take_one_identical_step(shards, tmp_path):
    sigma, config = 200.0, tiny_config()
    loop_config = worker_loop_config(config, shards, noise_multiplier=sigma)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_two_rank_step, args=(str(tmp_path / "init"), loop_config, results), nprocs=WORLD, join=True)
        results = dict(results)
    expected_std = sigma * config.privacy.max_grad_norm / config.private.batch_size
    for rank in range(WORLD):
        # Noise on both ranks would give sqrt(2) times this; on neither, almost nothing.
        assert results[rank]["gradient_std"] == pytest.approx(expected_std, rel=0.05)
    assert results[0]["fingerprints"][0] == results[0]["fingerprints"][1] == results[1]["fingerprints"][0]
    (start0, stop0), (start1, stop1) = results[0]["block"], results[1]["block"]
    assert start0 == 0 and stop0 == start1 and stop1 == SHARD_IMAGES
    assert all(start0 <= i < stop0 for i in results[0]["sampled"])
    assert all(start1 <= i < stop1 for i in results[1]["sampled"])


def test_rule_3_every_rank_and_every_run_gets_its_own_streams(shards):
    from tasks.stages.pretrain import build_worker_run

    loop_config = worker_loop_config(tiny_config(), shards)
    runs = [build_worker_run(loop_config, rank, WORLD) for _ in range(2) for rank in range(WORLD)]
    for purpose in ("sampling", "noise", "sample"):
        firsts = {tuple(getattr(run.step.streams, purpose).bits(4).tolist()) for run in runs}
        assert len(firsts) == len(runs), f"two ranks or two runs share the {purpose} stream"


# ------------------------------------------------------------------------------------------------ rule 4


def test_rule_4_every_sample_of_a_step_gets_its_own_mask_across_microbatches():
    config = get_preset("tiny")
    torch.manual_seed(0)
    mae = build_mae(config.model)
    plan = direct_plan(dataset_size=16, batch_size=16, sigma=1.0, clip=1.0)  # q = 1: all 16 in one step
    step = PrivateStep(mae, plan, Schedule(peak_lr=1e-3, total_steps=6), physical_batch_size=4)
    image = torch.randn(1, 3, 32, 32)
    masks = []
    mae.register_forward_hook(lambda module, args, output: masks.append(output[2].detach()))
    step(lambda local, stream: (local, stream.uniform((len(local), mae.num_patches))),
         lambda model, inputs: model(image.expand(len(inputs[0]), -1, -1, -1), noise=inputs[1])[0])
    rows = torch.cat(masks[-4:])  # rows: [16, L], one per sample, from the 4 microbatches of one image
    assert rows.shape == (16, mae.num_patches)
    assert (rows.sum(1) == mae.num_patches * config.model.mask_ratio).all()
    assert len({tuple(row.tolist()) for row in rows}) == 16


def test_rule_4_a_samples_crop_and_flip_are_its_own_and_its_loss_depends_on_that_sample_only(shards):
    from tasks.stages.pretrain import build_worker_run

    config = tiny_config(**{"private.augmentation": "rrc_flip", "private.batch_size": 8})
    for _ in range(20):
        run = build_worker_run(worker_loop_config(config, shards), 0, 1)
        try:
            local = run.pipeline.sample()
            inputs = run.batch(local, run.step.streams.sample)  # pixels [k, 3, H, W], noise [k, L], crops [k, 5]
        finally:
            run.pipeline.close()
        if len(local) >= 3:
            break
    pixels, noise, crops = inputs
    assert len({tuple(row.tolist()) for row in crops}) == len(crops)  # one crop and flip per sample
    with torch.no_grad():
        losses = run.loss(run.model, inputs)  # [k]
        changed = pixels.clone(), noise, crops.clone()
        changed[0][1] = 255 - changed[0][1]
        changed[2][1] = torch.tensor([0.0, 0.0, 0.5, 0.5, 1.0 - float(crops[1, 4])])
        moved = run.loss(run.model, changed)  # [k]
    others = [i for i in range(len(local)) if i != 1]
    assert torch.allclose(moved[others], losses[others], rtol=1e-5, atol=1e-6)
    assert not torch.isclose(moved[1], losses[1])


# ------------------------------------------------------------------------------------------------ rule 5


def test_rule_5_every_trainable_mae_parameter_is_clipped_and_only_the_fixed_sincos_embeddings_are_frozen():
    mae = build_mae(get_preset("tiny").model)
    frozen = {name for name, p in mae.named_parameters() if not p.requires_grad}
    assert frozen == {"pos_embed", "decoder_pos_embed"}
    model_plan = plan_model(mae)
    covered = {id(p) for _, p in model_plan.plain}
    for layer in model_plan.layers:
        covered |= {id(p) for p in layer.params}
    trainable = {id(p) for p in mae.parameters() if p.requires_grad}
    assert covered == trainable
    assert {"cls_token", "mask_token"} <= {name for name, _ in model_plan.plain}


def test_rule_5_one_flat_clip_factor_scales_every_fine_tuning_parameter_including_tokens():
    torch.manual_seed(0)
    classifier = EncoderClassifier(build_encoder(get_preset("tiny").model), num_classes=3)
    images, labels = torch.randn(1, 3, 32, 32), torch.tensor([1])

    def loss_fn(model, inputs):
        return nn.functional.cross_entropy(model(inputs[0]), inputs[1], reduction="none")  # [b]

    named = [(n, p) for n, p in classifier.named_parameters() if p.requires_grad]
    raw = torch.autograd.grad(loss_fn(classifier, (images, labels)).sum(), [p for _, p in named])
    norm = math.sqrt(sum(float(g.square().sum()) for g in raw))
    privatized_gradients(classifier, loss_fn, (images, labels), max_grad_norm=norm / 10, noise_multiplier=0.0,
                         expected_batch_size=1.0)
    for (name, param), g in zip(named, raw):
        assert param.grad is not None, f"{name} was skipped"
        assert torch.allclose(param.grad, g / 10, rtol=1e-3, atol=1e-6 * norm), name
    tokens = dict(named)
    assert float(tokens["encoder.cls_token"].grad.abs().max()) > 0
    assert float(tokens["encoder.pos_embed"].grad.abs().max()) > 0


class TokenAlongPositions(nn.Module):
    """A ``[1, D]`` parameter added to ``[B, T, D]``: broadcast along the T positions, not the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.offset = nn.Parameter(torch.randn(1, 4))

    def forward(self, x):  # x: [B, T, D]
        return (self.proj(x) + self.offset).square().mean((1, 2))  # [B]


def test_rule_5_a_token_whose_stand_in_would_mix_samples_is_refused_by_name():
    # Microbatch size = T = 3: the [B, D] stand-in fits [T, D], and sample t's row would go to position t.
    plan = direct_plan(dataset_size=3, batch_size=3, sigma=1.0, clip=1.0)
    step = PrivateStep(TokenAlongPositions(), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=3)
    data = torch.randn(3, 3, 4)
    with pytest.raises(UnsupportedLayerError, match="'offset'.*mix samples"):
        step(lambda local, stream: local, lambda model, local: model(data[local]))


def test_rule_5_the_optimiser_trains_every_trainable_parameter():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    plan = direct_plan(dataset_size=4, batch_size=2, sigma=1.0, clip=1.0)
    with pytest.raises(ValueError, match="leave out trainable parameters"):
        PrivateStep(model, plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=2,
                    param_groups=[{"params": list(model[0].parameters())}])


def autocast_clipped_sums(mae, imgs, noise, clip, *, physical, strict=False):
    """``clipped_sum(indices)``: the engine's clipped sum (noise off) of samples ``indices`` of ``imgs`` with their
    masking ``noise``, the whole step under bf16 autocast on ``imgs``' device, flat in float64."""

    def clipped_sum(indices):
        with torch.autocast(imgs.device.type, dtype=torch.bfloat16):
            privatized_gradients(mae, lambda model, i: model(imgs[i], noise=noise[i])[0], indices,
                                 max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=1.0,
                                 physical_batch_size=physical, strict_float32=strict)
        return torch.cat([p.grad.reshape(-1).double() for p in mae.parameters() if p.requires_grad])

    return clipped_sum


@pytest.mark.parametrize("strict", [False, True], ids=["bf16-operands", "strict"])
def test_rule_5_a_step_under_an_enclosing_autocast_keeps_the_sensitivity_c(strict):
    # A caller may wrap the whole step in bf16 autocast, not only its forward: removing one sample must still move
    # the clipped sum by at most C (rule 12: norms and sums from the same bfloat16 operands, with their rounding
    # bounded; or IEEE float32 throughout).
    torch.manual_seed(0)
    mae, clip = build_mae(get_preset("tiny").model), 1e-3
    clipped_sum = autocast_clipped_sums(mae, torch.randn(8, 3, 32, 32), torch.rand(8, 64), clip, physical=4,
                                        strict=strict)
    everyone = clipped_sum(torch.arange(8))
    for left_out in range(8):
        neighbour = clipped_sum(torch.tensor([i for i in range(8) if i != left_out]))
        assert float((everyone - neighbour).norm()) <= clip * (1 + 1e-4), f"without sample {left_out}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("strict", [False, True], ids=["tensor-cores", "strict"])
def test_rule_5_on_cuda_under_bf16_removing_a_sample_moves_the_clipped_sum_by_at_most_c(strict):
    # On a GPU, bf16 kernels chosen by shape could make a sample's gradient depend on its microbatch: removing
    # one sample would then move the others' clipped gradients too. Every sample is clipped to C here.
    torch.manual_seed(0)
    device, clip, batch = torch.device("cuda"), 1e-4, 16
    mae = build_mae(get_preset("tiny").model).to(device)
    imgs, noise = torch.randn(batch, 3, 32, 32, device=device), torch.rand(batch, 64, device=device)
    clipped_sum = autocast_clipped_sums(mae, imgs, noise, clip, physical=8, strict=strict)
    everyone = clipped_sum(torch.arange(batch, device=device))
    for left_out in range(batch):
        neighbour = clipped_sum(torch.tensor([i for i in range(batch) if i != left_out], device=device))
        alone = clipped_sum(torch.tensor([left_out], device=device))
        assert float((everyone - neighbour).norm()) <= clip * (1 + 1e-4), f"without sample {left_out}"
        assert float((everyone - neighbour - alone).norm()) <= clip * 1e-3, f"the others moved without {left_out}"


@pytest.mark.parametrize("strict", [False, True])
def test_the_plans_strict_float32_setting_decides_how_the_private_step_computes(monkeypatch, strict):
    # privacy.strict_float32 (off by default) must reach the clipped sums of the one private step: IEEE float32
    # operands instead of the bfloat16 ones (docs/privacy.md, rule 12).
    dtypes = []
    matmul_group = per_sample.matmul_group
    monkeypatch.setattr(per_sample, "matmul_group",
                        lambda layers, acts, *a: dtypes.append(acts[0].dtype) or matmul_group(layers, acts, *a))
    budget = PrivacyConfig(noise_multiplier=1.0, max_grad_norm=1.0, target_epsilon=1e12, delta=1e-3,
                           accountant="rdp", strict_float32=strict)
    plan = plan_privacy(budget, dataset_size=8, batch_size=8, steps=2, fingerprint="data")
    assert plan.strict_float32 == strict
    torch.manual_seed(0)
    model, inputs = nn.Linear(16, 24), torch.randn(8, 3, 16)

    def autocast_loss(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float().square().sum((1, 2))

    step = PrivateStep(model, plan, Schedule(peak_lr=0.1, total_steps=2), physical_batch_size=4)
    step(lambda local, stream: inputs[local], autocast_loss)
    assert dtypes == [torch.float32 if strict else torch.bfloat16] * 2  # one per microbatch of 4


def test_rule_6_epsilon_every_step_and_a_stop_before_the_target_would_be_passed():
    loss_fn = regression_problem()
    eps = [compute_epsilon(noise_multiplier=1.0, sample_rate=0.25, steps=s, delta=1e-3, accountant="rdp")
           for s in range(1, 7)]
    target = (eps[2] + eps[3]) / 2  # three steps fit, a fourth would pass the target
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0, target_epsilon=target)
    step = PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
    reports = []
    result = run_steps(step, lambda local, stream: local, loss_fn, until=6, on_step=reports.append)
    assert result.stopped_by_budget and result.steps == 3
    assert [r.epsilon for r in reports] == pytest.approx(eps[:3])
    assert max(r.epsilon for r in reports) <= target


def test_rule_6_a_step_interrupted_after_the_noised_gradient_was_applied_is_still_counted(monkeypatch):
    """A Ctrl-C between the optimiser's update and the end of the step, then the run goes on (a notebook): every
    update made from a noised gradient must be in the ledger, or ε is understated."""
    loss_fn = regression_problem()
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0)
    step = PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
    before = [p.detach().clone() for p in step.model.parameters()]
    zero_grad = step.optimizer.zero_grad

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(step.optimizer, "zero_grad", zero_grad)
        raise KeyboardInterrupt

    monkeypatch.setattr(step.optimizer, "zero_grad", interrupted)
    with pytest.raises(KeyboardInterrupt):
        step(lambda local, stream: local, loss_fn)
    assert any(not torch.equal(a, p) for a, p in zip(before, step.model.parameters()))  # the update was applied
    assert step.ledger.steps == step.taken == 1  # the run's charge is settled from these
    step(lambda local, stream: local, loss_fn)
    assert step.ledger.steps == step.taken == 2


@pytest.mark.parametrize(("field", "changed"), [
    ("noise_multiplier", {"noise_multiplier": 0.25}),  # σ/4: would train at σ/4 and account at σ
    ("fingerprint", {"fingerprint": "other-shards-of-the-same-size"}),
    ("batch_size", {"sample_rate": 0.5, "batch_size": 32}),
    ("steps", {"steps": 40}),  # more steps than the run was charged for, past what later runs left it
    ("target_epsilon", {"target_epsilon": 1e10}),
    ("delta", {"delta": 1e-2}),
    ("accountant", {"accountant": "pld"}),
])
def test_rule_6_resume_refuses_a_checkpoint_of_another_plan_naming_the_field(field, changed):
    loss_fn = regression_problem()
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0)
    first = PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
    run_steps(first, lambda local, stream: local, loss_fn, until=2)
    other = PrivacyPlan.from_dict({**plan.to_dict(), **changed})
    resumed = PrivateStep(nn.Linear(6, 1), other, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
    with pytest.raises(ValueError, match=f"resume refused: the checkpoint was trained with {field}="):
        resumed.load_state_dict(first.state_dict(), first.stream_state())


def test_rule_6_resume_refuses_a_plan_composed_with_other_runs():
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0)
    first = PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
    other = PrivacyPlan.from_dict({**plan.to_dict(), "prior": [
        {"run": "r", "noise_multiplier": 1.0, "sample_rate": 0.5, "steps": 3, "purpose": "pretrain-dp"}]})
    resumed = PrivateStep(nn.Linear(6, 1), other, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
    with pytest.raises(ValueError, match="resume refused: .*0 earlier runs composed in, the plan composes 1"):
        resumed.load_state_dict(first.state_dict())


def test_rule_6_resume_refuses_a_checkpoint_of_an_earlier_run_of_the_plan():
    """Run 1's ledger starts at run 0's planned steps: run 0's checkpoint there would count its steps from below
    that start, and the run's charge would be settled short."""
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0)
    first = PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
    run_steps(first, lambda local, stream: local, regression_problem(), until=2)
    second = PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4,
                         earlier_runs=1)
    with pytest.raises(ValueError, match="resume refused: the checkpoint's ledger counts 2 steps, fewer than this "
                                         f"run's earlier runs' {plan.steps} and its own 2"):
        second.load_state_dict(first.state_dict(), first.stream_state())
    assert second.counted == 0 and second.taken == 0  # nothing of the checkpoint was taken in


def test_rule_6_resume_refuses_a_ledger_that_disagrees_with_its_plan():
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0)
    step = PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
    state = step.state_dict()
    state["ledger"]["noise_multiplier"] = 4.0
    with pytest.raises(ValueError, match="ledger noise_multiplier=4.0"):
        PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6),
                    physical_batch_size=4).load_state_dict(state)


def test_rule_6_the_pretraining_driver_refuses_to_resume_on_other_data_or_settings(shards, tmp_path):
    from tasks.stages.pretrain import stage_plan

    config = tiny_config(**{"privacy.noise_multiplier": None, "privacy.target_epsilon": 8.0})
    output = tmp_path / "run"
    stage_plan(config, "private", measure_shards(shards), output, continuing=False)
    with pytest.raises(ValueError, match="resume refused: the run was planned with batch_size"):
        stage_plan(with_overrides(config, {"private.batch_size": 5}), "private", measure_shards(shards), output,
                   continuing=True)
    other = tmp_path / "other-shards"  # the same number of images, other bytes
    with ShardWriter(other, prefix="web", samples_per_shard=4) as writer:
        for i in range(SHARD_IMAGES):
            pixels = np.random.default_rng(100 + i).integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
            writer.write(f"{i:05d}", {"png": encode_image(Image.fromarray(pixels), "png"), "json": {"i": i}})
    with pytest.raises(ValueError, match="resume refused: the run was planned with fingerprint"):
        stage_plan(config, "private", measure_shards(other), output, continuing=True)


def test_rule_6_a_private_run_cannot_resume_without_privacy(shards, tmp_path):
    from tasks.stages.pretrain import stage_plan

    config = tiny_config(**{"privacy.noise_multiplier": None, "privacy.target_epsilon": 8.0})
    stage_plan(config, "private", measure_shards(shards), tmp_path, continuing=False)
    with pytest.raises(ValueError, match="resume refused: the run was planned with private=True"):
        stage_plan(with_overrides(config, {"privacy.enabled": False}), "private", measure_shards(shards), tmp_path,
                   continuing=True)


def test_rule_6_delta_from_the_measured_size_and_a_calibrated_sigma_that_never_overspends(shards):
    config = tiny_config(**{"privacy.noise_multiplier": None, "privacy.target_epsilon": 8.0, "private.steps": 20})
    plan = PrivacyPlan.from_dict(worker_loop_config(config, shards)["plan"]["privacy"])
    assert plan.dataset_size == SHARD_IMAGES and plan.delta == 1 / (2 * SHARD_IMAGES)
    accounting = dict(sample_rate=plan.sample_rate, steps=20, delta=plan.delta, accountant="rdp")
    assert plan.epsilon <= 8.0
    assert compute_epsilon(noise_multiplier=plan.noise_multiplier, **accounting) <= 8.0
    assert compute_epsilon(noise_multiplier=plan.noise_multiplier * 0.99, **accounting) > 8.0


def test_rule_6_accountant_at_the_papers_rate_and_delta():
    n = 233_804_767
    q, delta = 98_304 / n, 1 / (2 * n)  # q ≈ 4.2e-4, δ ≈ 2.1e-9
    pld = compute_epsilon(noise_multiplier=0.4568, sample_rate=q, steps=6_000, delta=delta, accountant="pld")
    rdp = compute_epsilon(noise_multiplier=0.4568, sample_rate=q, steps=6_000, delta=delta, accountant="rdp")
    assert 7.9 < pld <= 8.0 < rdp  # PLD tight, RDP a looser upper bound
    assert compute_epsilon(noise_multiplier=0.4568, sample_rate=q, steps=5_999, delta=delta) < pld


# ------------------------------------------------------------------------------------------------ rule 7


def test_rule_7_users_are_told_the_guarantee_covers_the_private_data_only():
    privacy_doc = " ".join((REPO / "docs" / "privacy.md").read_text().lower().split())
    readme = " ".join((REPO / "README.md").read_text().lower().split())
    assert "private pre-training data only" in privacy_doc and "evaluation data is public" in privacy_doc
    assert "private pre-training data only" in readme and "public" in readme
    assert "public" in (EvaluationConfig.__doc__ or "").lower()


# ------------------------------------------------------------------------------------------------ rule 8


def test_rule_8_two_private_steps_of_one_config_never_share_noise_samples_or_masks():
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0)
    draws = []
    for _ in range(2):
        torch.manual_seed(0)  # the same public seed, config and weights
        step = PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
        draws.append([step.streams.noise.normal((8,), 1.0), step.sampler.sample(), step.streams.sample.uniform((8,))])
    for first, second in zip(*draws):
        assert not torch.equal(first, second)


def test_rule_8_a_secure_plan_draws_every_stream_from_the_os_csprng():
    plan = PrivacyPlan.from_dict({**direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0).to_dict(),
                                  "secure_mode": True})
    step = PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
    for stream in (step.streams.sampling, step.streams.noise, step.streams.sample):
        assert stream.mode == "secure" and set(stream.state_dict()) == {"mode", "purpose"}
    run_steps(step, lambda local, stream: local, regression_problem(), until=2)



@pytest.mark.parametrize("secure, mode", [(False, "default"), (True, "secure")])
def test_rule_8_dp_fine_tuning_augments_from_fresh_entropy_and_from_the_csprng_in_secure_mode(secure, mode):
    from vip_core.config import FinetunePrivacyConfig
    from vip_core.eval.jobs import dp_augmentation_stream

    streams = [dp_augmentation_stream(FinetunePrivacyConfig(enabled=True, secure_mode=secure)) for _ in range(2)]
    assert all(stream.mode == mode for stream in streams)
    assert not torch.equal(streams[0].uniform((8,)), streams[1].uniform((8,)))

def test_rule_8_dp_fine_tuning_noise_and_sample_are_not_a_function_of_the_public_config(tmp_path):
    from vip_core.eval.dp_finetune import dp_finetune, plan_dp_finetune

    data = torch.Generator().manual_seed(1)
    images = TensorDataset(torch.randn(32, 3, 32, 32, generator=data), torch.randint(0, 3, (32,), generator=data))
    settings = FinetuneSettings(epochs=1, lr=1e-3, batch_size=8, layer_decay=0.75)
    private = with_overrides(get_preset("tiny"), {
        "evaluation.finetune_privacy.enabled": True, "evaluation.finetune_privacy.noise_multiplier": 1.0,
        "evaluation.finetune_privacy.target_epsilon": 1e6, "evaluation.finetune_privacy.batch_size": 8,
        "evaluation.finetune_privacy.physical_batch_size": 8, "evaluation.finetune_privacy.steps": 2,
        "evaluation.finetune_privacy.accountant": "rdp"}).evaluation.finetune_privacy
    plan = plan_dp_finetune(private, images, ["a", "b"], tmp_path)
    updates = []
    for index, run in enumerate(("a", "b")):
        torch.manual_seed(123)
        classifier = EncoderClassifier(build_encoder(get_preset("tiny").model), 3)
        start = flat_parameters(classifier)
        dp_finetune(classifier, images, settings, private, plan, torch.device("cpu"), run=run, ledgers=tmp_path,
                    earlier_runs=index)
        updates.append(flat_parameters(classifier) - start)
    assert not torch.equal(updates[0], updates[1]), "two DP fine-tuning runs with one config drew the same noise"


# ------------------------------------------------------------------------------------------------ rule 9


def test_rule_9_a_second_run_on_a_private_set_is_composed_with_the_first(tmp_path):
    from vip_core.privacy.plan import plan_and_charge

    book = LedgerBook.for_data_set("set", tmp_path)
    config = get_preset("tiny")
    planning = dict(dataset_size=1_000, batch_size=64, steps=10, fingerprint="set")
    first = plan_and_charge(book, runs=["first"], purpose="pretrain-dp",
                            budget=config.privacy.model_copy(update={"target_epsilon": 4.0}), **planning)
    second = plan_and_charge(book, runs=["second"], purpose="pretrain-dp", budget=config.privacy, **planning)
    composed = composed_epsilon([(first.noise_multiplier, 0.064, 10), (second.noise_multiplier, 0.064, 10)],
                                delta=second.delta, accountant="pld")
    assert second.prior == (first.charge("first", "pretrain-dp"),)
    assert second.epsilon == pytest.approx(composed) and composed <= 8.0
    ledger = second.ledger()
    for _ in range(10):
        ledger.record_step()
    assert ledger.epsilon == pytest.approx(composed)  # the ε a run reports is the set's composed ε


def test_rule_9_dp_fine_tuning_charges_both_encoders_and_reports_the_composed_epsilon(tmp_path):
    from tasks.fixtures.eval_sets import make_digits_imagefolder
    from vip_core.eval.jobs import prepare_job

    folder = tmp_path / "digits"
    make_digits_imagefolder(folder, img_size=32, per_class=10)
    evaluation = with_overrides(get_preset("tiny"), {
        "evaluation.finetune_privacy.enabled": True, "evaluation.finetune_privacy.batch_size": 8,
        "evaluation.finetune_privacy.physical_batch_size": 8, "evaluation.finetune_privacy.steps": 2,
        "evaluation.finetune_privacy.accountant": "rdp"}).evaluation
    model = get_preset("tiny").model
    job = prepare_job("finetune", folder, evaluation, model, torch.device("cpu"), runs=["result", "baseline"],
                      ledgers=tmp_path / "ledgers")
    charges = list((tmp_path / "ledgers").glob("*.json"))
    assert len(charges) == 1  # both runs charged before either trains
    book = LedgerBook(charges[0], job.privacy["fingerprint"])
    assert [c.steps for c in book.charges()] == [2, 2]
    torch.manual_seed(0)
    first = job(build_encoder(model))
    second = job(build_encoder(model))
    sigma, q = first["dp_noise_multiplier"], first["dp_sample_rate"]
    one = compute_epsilon(noise_multiplier=sigma, sample_rate=q, steps=2, delta=first["dp_delta"], accountant="rdp")
    both = compute_epsilon(noise_multiplier=sigma, sample_rate=q, steps=4, delta=first["dp_delta"], accountant="rdp")
    assert first["dp_epsilon"] == second["dp_epsilon"] == pytest.approx(both)  # what either result may claim
    assert first["dp_epsilon_after_this_run"] == pytest.approx(one)
    assert second["dp_epsilon_after_this_run"] == pytest.approx(both)
    assert both <= evaluation.finetune_privacy.target_epsilon
    assert [role for role, _ in job.privacy["runs"]] == ["result", "baseline"]
    with pytest.raises(RuntimeError, match="planned for 2 runs"):
        job(build_encoder(model))


def test_rule_9_training_on_the_private_set_without_privacy_spends_its_whole_budget(shards, tmp_path):
    from tasks.stages.pretrain import ledger_book, stage_plan

    data = measure_shards(shards)
    config = tiny_config(**{"privacy.noise_multiplier": None, "privacy.target_epsilon": 8.0})
    stage_plan(with_overrides(config, {"privacy.enabled": False}), "private", data, tmp_path / "plain", False)
    book = ledger_book(data.fingerprint)
    assert book.epsilon(delta=1e-3, accountant="pld") == math.inf
    with pytest.raises(Exception, match=r"privacy\.target_epsilon: 8\.0 cannot be met.*pretrain-nonprivate"):
        stage_plan(config, "private", data, tmp_path / "dp", False)


def test_rule_9_a_data_set_is_the_same_set_whatever_its_shards_or_folders_are_called(shards, tmp_path):
    from vip_core.eval.datasets import open_classification
    from vip_core.eval.dp_finetune import dataset_fingerprint
    from tasks.fixtures.eval_sets import make_digits_imagefolder

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for index, shard in enumerate(measure_shards(shards).shards):
        (renamed / f"other-name-{index:06d}.tar").write_bytes(shard.read_bytes())
    assert measure_shards(renamed).fingerprint == measure_shards(shards).fingerprint
    folder = tmp_path / "digits"
    make_digits_imagefolder(folder, img_size=32, per_class=3)
    (tmp_path / "link").symlink_to(folder)
    ways = [folder, tmp_path / "link", Path(os.path.relpath(folder))]
    prints = {dataset_fingerprint(open_classification(way).split("train", 32)) for way in ways}
    assert len(prints) == 1


# ------------------------------------------------------------------------------------------------ rule 10


def test_rule_10_the_published_checkpoint_is_the_allow_list_and_nothing_else():
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0)
    step = PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
    run_steps(step, lambda local, stream: local, regression_problem(), until=2)
    training_checkpoint = {"model": step.model.state_dict(), "config": {"name": "x"}, "stage": "private",
                           "step": 2, "state": step.state_dict(), "streams": [step.stream_state()], "resumes": 0,
                           "last_loss": 0.5}
    published = release_payload(training_checkpoint)
    assert tuple(published) == PUBLISHED_ENTRIES == ("model", "config", "step", "ledger", "ema")
    assert published["ema"] is None  # a run without ema_decay
    assert set(published["ledger"]) == {"epsilon", "delta", "noise_multiplier", "sample_rate", "steps", "accountant",
                                        "adjacency", "composed_with"}
    assert published["ledger"]["adjacency"] == "zero-out"
    assert published["ledger"]["steps"] == 2 and published["ledger"]["epsilon"] == pytest.approx(step.epsilon)


# ------------------------------------------------------------------------------------------------ rule 11

# Calls that add noise or advance a ledger, and the one module allowed to make them outside the privacy
# package itself; the CLI's ε calculator and planning are the only other users of the accountant.
NOISE_OR_LEDGER = {"privatize", "privatized_gradients", "record_step", "ClippedGradientSum"}
PLANNING = {"calibrate_noise_multiplier"}
ALLOWED = {
    "privatize": {"vip_core/train/step.py", "vip_core/privacy/engine.py"},
    "privatized_gradients": {"vip_core/privacy/engine.py", "tasks/benchmarks/dp_step.py"},
    "record_step": {"vip_core/train/step.py", "vip_core/privacy/ledger.py"},
    "ClippedGradientSum": {"vip_core/train/step.py", "vip_core/privacy/engine.py"},
    "calibrate_noise_multiplier": {"vip_core/privacy/plan.py", "vip_core/privacy/accounting.py",
                                   "tasks/cli/privacy.py"},
}


def _uses(name: str) -> set[str]:
    found = set()
    for path in [*REPO.glob("vip_core/**/*.py"), *REPO.glob("tasks/**/*.py"), *REPO.glob("flows/**/*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            called = node.func if isinstance(node, ast.Call) else None
            target = getattr(called, "attr", None) or getattr(called, "id", None)
            if target == name or (isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names)):
                found.add(str(path.relative_to(REPO)))
    return found


@pytest.mark.parametrize("name", sorted(NOISE_OR_LEDGER | PLANNING))
def test_rule_11_only_the_one_private_step_adds_noise_or_advances_a_ledger(name):
    assert _uses(name) <= ALLOWED[name], f"{name} is used outside the one private step: {_uses(name) - ALLOWED[name]}"


def test_rule_6_a_new_sum_drops_the_gradients_that_were_views_of_its_buffer():
    """After a step interrupted before its optimiser cleared them, the parameters' gradients are views of the engine's
    buffer: the next step's noise and sums, not yet privatized (on ranks other than 0, without noise), must not be
    readable through them."""
    loss_fn = regression_problem()
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0)
    step = PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=4)
    clipped = step.engine.clipped_sum(noise_multiplier=1.0, noise=step.streams.noise)
    clipped.add(loss_fn, torch.arange(8))
    clipped.privatize(expected_batch_size=16.0)
    assert all(p.grad is not None for p in step.model.parameters())  # as an interrupted step leaves them
    step.engine.clipped_sum(noise_multiplier=1.0, noise=step.streams.noise).add(loss_fn, torch.arange(8, 16))
    assert all(p.grad is None for p in step.model.parameters())


def test_rule_6_gradients_kept_from_an_earlier_step_show_nothing_of_a_step_that_failed():
    """An observer may keep the gradients it was shown (to log them later): they are views of the engine's buffer,
    which the next step fills with noise and sums not privatized (on ranks other than 0, without noise); a step that
    fails must leave nothing of its samples there."""
    loss_fn = regression_problem()
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0)
    step = PrivateStep(nn.Linear(6, 1), plan, Schedule(peak_lr=0.1, total_steps=6), physical_batch_size=1)
    kept = []
    step(lambda local, stream: local, loss_fn, lambda model: kept.extend(p.grad.detach() for p in model.parameters()))
    calls = []

    def fails_on_the_second_microbatch(model, indices):
        calls.append(indices)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return loss_fn(model, indices)

    with pytest.raises(RuntimeError, match="out of memory"):
        step(lambda local, stream: local, fails_on_the_second_microbatch)
    assert all(bool((values == 0).all()) for values in kept)
