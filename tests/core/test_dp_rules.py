"""The privacy review's checks: at least one test per differential-privacy rule of DESIGN.md, each one
failing if its rule is broken. They drive the code paths a run uses: the plan, the single-process loop
step (vip_core.train.loop) and the Ray worker's step (tasks.pretrain.train_step, called directly, on two
real gloo processes for rule 3). docs/privacy.md says which test checks which rule.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from torch import nn

from vip_core.config import EvaluationConfig, get_preset, with_overrides
from vip_core.data.shards import ShardWriter, encode_image
from vip_core.eval.finetune import EncoderClassifier
from vip_core.models.checkpoint import load_checkpoint
from vip_core.models.mae import build_encoder, build_mae
from vip_core.privacy.accounting import compute_epsilon
from vip_core.privacy.engine import plan_model, privatized_gradients
from vip_core.privacy.ledger import PrivacyLedger
from vip_core.privacy.plan import PrivacyPlan, plan_privacy
from vip_core.privacy.sampling import PoissonSampler
from vip_core.train.data import ShardPartition, shard_counts
from vip_core.train.distributed import gather_objects, parameters_fingerprint
from vip_core.train.loop import TrainState, build_state, mae_index_loss, private_step, train_private

REPO = Path(__file__).resolve().parents[2]
SHARD_IMAGES = 11  # divides evenly among neither 2 nor 3 workers
WORLD = 2


# ------------------------------------------------------------------------------------------------ helpers


def tiny_config(**overrides):
    """The tiny preset with a constant learning rate of 1 (so SGD's update is minus the gradient)."""
    base = {
        "private.batch_size": 4, "private.physical_batch_size": 2, "private.steps": 10, "private.lr": 1.0,
        "private.warmup_steps": 0, "private.schedule": "constant", "privacy.noise_multiplier": 1.0,
        "privacy.target_epsilon": 1000.0, "privacy.accountant": "rdp",
    }
    return with_overrides(get_preset("tiny"), {**base, **overrides})


def direct_plan(*, dataset_size: int, batch_size: int, sigma: float, clip: float, steps: int = 6,
                target_epsilon: float = 1e9, delta: float = 1e-3) -> PrivacyPlan:
    """A plan with any σ (0 included), for tests that need the clipped sum without noise."""
    q = batch_size / dataset_size
    epsilon = compute_epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=delta, accountant="rdp")
    return PrivacyPlan(dataset_size=dataset_size, batch_size=batch_size, sample_rate=q, steps=steps, delta=delta,
                       noise_multiplier=sigma, max_grad_norm=clip, target_epsilon=target_epsilon, epsilon=epsilon,
                       accountant="rdp")


def sgd_state(model: nn.Module, plan: PrivacyPlan, seed: int) -> TrainState:
    """A loop state whose optimizer is plain SGD: the parameter change is exactly -lr * gradient."""
    state = build_state(model, plan, tiny_config().private, seed=seed)
    state.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return state


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters() if p.requires_grad])


def one_at_a_time_clipped_sum(model: nn.Module, loss_fn, inputs: torch.Tensor, clip: float) -> torch.Tensor:
    """Σᵢ clip(gᵢ, C), flat, each gᵢ from its own backward pass."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for i in range(len(inputs)):
        grads = torch.autograd.grad(loss_fn(model, inputs[i:i + 1]).sum(), params)
        flat = torch.cat([g.reshape(-1).double() for g in grads])
        total += flat * min(1.0, clip / (float(flat.norm()) + 1e-6))
    return total


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """11 random 32 px PNG images in shards of 4, 4 and 3."""
    folder = tmp_path_factory.mktemp("private-shards")
    with ShardWriter(folder, prefix="web", samples_per_shard=4) as writer:
        for i in range(SHARD_IMAGES):
            pixels = np.random.default_rng(i).integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
            writer.write(f"{i:05d}", {"png": encode_image(Image.fromarray(pixels), "png"), "json": {"i": i}})
    return folder


def worker_loop_config(config, shards_folder: Path, **plan_changes) -> dict:
    """What tasks.pretrain's driver hands every Ray worker, for the private stage of ``config``."""
    from tasks.pretrain import _privacy_plan

    shard_files, counts = shard_counts(shards_folder)
    plan = {**_privacy_plan(config, "private", sum(counts)), **plan_changes}
    return {"config": config.model_dump(mode="json"), "stage": "private", "shards": [str(s) for s in shard_files],
            "counts": counts, "plan": plan, "init_checkpoint": None}


# ------------------------------------------------------------------------------------------------ rule 1


def test_rule_1_the_loop_samples_at_the_plans_rate_and_the_ledger_accounts_that_rate():
    config = tiny_config(**{"private.batch_size": 16})
    plan = plan_privacy(config, 64)
    state = build_state(nn.Linear(2, 1), plan, config.private, seed=0)
    assert plan.sample_rate == 16 / 64
    assert state.sampler.sample_rate == state.ledger.sample_rate == plan.sample_rate
    assert state.sampler.dataset_size == plan.dataset_size == 64


def test_rule_1_draws_are_poisson_not_shuffled_or_fixed_size_batches():
    n, q, steps = 50, 0.2, 2000
    sampler = PoissonSampler(n, q, torch.Generator().manual_seed(0))
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


def test_rule_1_ray_workers_together_sample_every_example_at_the_accounted_rate(shards):
    from tasks.pretrain import build_worker_state

    world = 3  # 11 images: blocks of 3, 4 and 4, nothing dropped
    loop_config = worker_loop_config(tiny_config(), shards)
    plan = loop_config["plan"]
    states = [build_worker_state(loop_config, rank, world) for rank in range(world)]
    assert plan["sample_rate"] == 4 / SHARD_IMAGES and plan["dataset_size"] == SHARD_IMAGES
    covered = []
    for state in states:
        assert state.sampler.sample_rate == state.ledger.sample_rate == plan["sample_rate"]
        assert state.sampler.dataset_size == len(state.partition)
        covered += range(state.partition.start, state.partition.stop)
    assert sorted(covered) == list(range(SHARD_IMAGES))
    steps = 400
    counts = torch.zeros(SHARD_IMAGES)
    for _ in range(steps):
        for state in states:
            counts[state.partition.global_indices(state.sampler.sample())] += 1
    mean, sd = steps * plan["sample_rate"], math.sqrt(steps * plan["sample_rate"] * (1 - plan["sample_rate"]))
    assert ((counts - mean).abs() < 5 * sd).all(), counts.tolist()


# ------------------------------------------------------------------------------------------------ rule 2


def test_rule_2_loop_step_divides_the_clipped_sum_by_the_expected_not_the_realised_size():
    data, targets = torch.randn(64, 6), torch.randn(64, 1)

    def loss_fn(model, indices):
        return (model(data[indices]) - targets[indices]).square().sum(-1)  # [b]

    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    reference_model = copy.deepcopy(model)
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=0.0, clip=0.05)
    state = sgd_state(model, plan, seed=3)
    replay = PoissonSampler(64, plan.sample_rate, torch.Generator())
    replay.load_state_dict(state.sampler.state_dict())
    before = flat_parameters(model)
    private_step(state, loss_fn, plan, tiny_config().private)
    gradient = before - flat_parameters(model)
    indices = replay.sample()
    assert len(indices) != plan.batch_size  # the two divisors differ, so the check below can tell them apart
    clipped_sum = one_at_a_time_clipped_sum(reference_model, loss_fn, indices, plan.max_grad_norm)
    assert torch.allclose(gradient * plan.batch_size, clipped_sum, rtol=1e-4, atol=1e-7)


def test_rule_2_ray_worker_step_divides_by_the_expected_batch_size(shards):
    from tasks.pretrain import build_worker_state, train_step

    config = tiny_config()
    state = build_worker_state(worker_loop_config(config, shards, noise_multiplier=0.0), 0, 1)
    state.optimizer = torch.optim.SGD(state.model.parameters(), lr=1.0)
    seed = _seed_of_a_batch_whose_size_is_not(config.private.batch_size, len(state.partition), state.plan["sample_rate"])
    state.sampler = PoissonSampler(len(state.partition), state.plan["sample_rate"], torch.Generator().manual_seed(seed))
    reference_model = copy.deepcopy(state.model)
    sampling, masking = torch.Generator().manual_seed(seed), torch.Generator()
    masking.set_state(state.masking.get_state())
    before = flat_parameters(state.model)
    train_step(state, rank=0)
    gradient = before - flat_parameters(state.model)

    local = PoissonSampler(len(state.partition), state.plan["sample_rate"], sampling).sample()  # [k]
    noise = reference_model.masking_noise(len(local), masking)  # [k, L]
    assert len(local) != config.private.batch_size

    def loss_fn(model, inputs):
        indices, rows = inputs
        return model(state.partition.images(indices), noise=rows)[0]  # [b]

    privatized_gradients(reference_model, loss_fn, (local, noise), max_grad_norm=config.privacy.max_grad_norm,
                         noise_multiplier=0.0, expected_batch_size=1.0)
    clipped_sum = torch.cat([p.grad.reshape(-1).double() for p in reference_model.parameters() if p.requires_grad])
    scale = float(clipped_sum.abs().max())
    assert torch.allclose(gradient * config.private.batch_size, clipped_sum, rtol=1e-3, atol=1e-5 * scale)


def _seed_of_a_batch_whose_size_is_not(batch_size: int, dataset_size: int, sample_rate: float) -> int:
    """A sampler seed whose first Poisson batch is neither empty nor of the expected size."""
    for seed in range(100):
        size = len(PoissonSampler(dataset_size, sample_rate, torch.Generator().manual_seed(seed)).sample())
        if size not in (0, batch_size):
            return seed
    raise AssertionError("no such seed")


# ------------------------------------------------------------------------------------------------ rule 3


def test_rule_3_every_rank_and_every_run_gets_its_own_unpredictable_streams(shards):
    from tasks.pretrain import build_worker_state

    loop_config = worker_loop_config(tiny_config(), shards)
    runs = [[build_worker_state(loop_config, rank, WORLD) for rank in range(WORLD)] for _ in range(2)]
    states = [state for run in runs for state in run]
    for purpose in ("sampling", "noise", "masking"):
        generators = [state.sampler.generator if purpose == "sampling" else getattr(state, purpose) for state in states]
        firsts = {tuple(torch.rand(8, generator=g).tolist()) for g in generators}
        assert len(firsts) == len(states), f"two ranks or two runs share the {purpose} stream"


def test_rule_3_dp_fine_tuning_noise_and_sample_are_not_a_function_of_the_public_config():
    from torch.utils.data import TensorDataset

    from vip_core.eval.finetune import DPSettings, FinetuneSettings, dp_finetune, plan_dp

    data = torch.Generator().manual_seed(1)
    images = TensorDataset(torch.randn(32, 3, 32, 32, generator=data), torch.randint(0, 3, (32,), generator=data))
    settings = FinetuneSettings(epochs=1, lr=1e-3, batch_size=8, layer_decay=0.75)
    dp = DPSettings(target_epsilon=8.0, delta=None, max_grad_norm=1.0, noise_multiplier=1.0, batch_size=8,
                    physical_batch_size=8, steps=2, accountant="rdp")
    plan = plan_dp(dp, len(images))
    updates = []
    for _ in range(2):
        torch.manual_seed(123)
        classifier = EncoderClassifier(build_encoder(get_preset("tiny").model), 3)
        start = flat_parameters(classifier)
        dp_finetune(classifier, images, settings, dp, plan, torch.device("cpu"))
        updates.append(flat_parameters(classifier) - start)
    assert not torch.equal(updates[0], updates[1]), "two DP fine-tuning runs with one config drew the same noise"


def _two_rank_step(rank: int, init_file: str, loop_config: dict, results: dict) -> None:
    from tasks.pretrain import build_worker_state, train_step

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        state = build_worker_state(loop_config, rank, WORLD)
        state.optimizer = torch.optim.SGD(state.model.parameters(), lr=1.0)
        sampling = torch.Generator()
        sampling.set_state(state.sampler.generator.get_state())
        before = flat_parameters(state.model)
        train_step(state, rank)
        update = before - flat_parameters(state.model)
        local = PoissonSampler(len(state.partition), state.plan["sample_rate"], sampling).sample()
        results[rank] = {
            "update_std": update.std().item(),
            "fingerprints": gather_objects(parameters_fingerprint(state.model)),
            "block": (state.partition.start, state.partition.stop),
            "sampled": state.partition.global_indices(local).tolist(),
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
        assert results[rank]["update_std"] == pytest.approx(expected_std, rel=0.05)
    assert results[0]["fingerprints"][0] == results[0]["fingerprints"][1] == results[1]["fingerprints"][0]
    (start0, stop0), (start1, stop1) = results[0]["block"], results[1]["block"]
    assert start0 == 0 and stop0 == start1 and stop1 == SHARD_IMAGES
    assert all(start0 <= i < stop0 for i in results[0]["sampled"])
    assert all(start1 <= i < stop1 for i in results[1]["sampled"])


# ------------------------------------------------------------------------------------------------ rule 4


def test_rule_4_every_sample_of_a_loop_step_gets_its_own_mask_across_microbatches():
    config = tiny_config(**{"private.physical_batch_size": 4})
    torch.manual_seed(0)
    mae = build_mae(config.model)
    plan = direct_plan(dataset_size=16, batch_size=16, sigma=1.0, clip=1.0)  # q = 1: all 16 in one step
    state = build_state(mae, plan, config.private, seed=0)
    image = torch.randn(1, 3, 32, 32)
    masks = []
    mae.register_forward_hook(lambda module, args, output: masks.append(output[2].detach()))
    private_step(state, mae_index_loss(lambda idx: image.expand(len(idx), -1, -1, -1), state.masking), plan,
                 config.private)
    rows = torch.cat(masks)  # rows: [16, L], one per sample, from 4 microbatches of the same image
    assert len(masks) == 4 and rows.shape == (16, mae.num_patches)
    assert (rows.sum(1) == mae.num_patches * config.model.mask_ratio).all()
    assert len({tuple(row.tolist()) for row in rows}) == 16


# ------------------------------------------------------------------------------------------------ rule 5


def test_rule_5_every_trainable_mae_parameter_is_clipped_and_only_the_fixed_sincos_embeddings_are_frozen():
    mae = build_mae(get_preset("tiny").model)
    frozen = {name for name, p in mae.named_parameters() if not p.requires_grad}
    assert frozen == {"pos_embed", "decoder_pos_embed"}
    model_plan = plan_model(mae)
    covered = {id(p) for _, p in model_plan.plain}
    for _, module, _ in model_plan.layers:
        covered |= {id(p) for p in module.parameters(recurse=False) if p.requires_grad}
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


# ------------------------------------------------------------------------------------------------ rule 6


def test_rule_6_epsilon_every_step_budget_stop_and_a_resume_that_continues_the_ledger(tmp_path):
    data = torch.randn(64, 6)

    def loss_fn(model, indices):
        return model(data[indices]).square().sum(-1)  # [b]

    eps = [compute_epsilon(noise_multiplier=1.0, sample_rate=0.25, steps=s, delta=1e-3, accountant="rdp")
           for s in range(1, 7)]
    target = (eps[2] + eps[3]) / 2  # three steps fit, a fourth would pass the target
    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0, target_epsilon=target)
    config = tiny_config(**{"private.steps": 6, "private.checkpoint_every": 1})
    torch.manual_seed(0)
    first = train_private(build_state(nn.Linear(6, 1), plan, config.private, seed=0), loss_fn, plan, config,
                          output=tmp_path)
    assert first.stopped_by_budget and first.steps == 3
    assert [r.epsilon for r in first.reports] == pytest.approx(eps[:3])
    assert max(r.epsilon for r in first.reports) <= target
    saved = load_checkpoint(tmp_path)
    assert saved["ledger"]["steps"] == 3 and saved["step"] == 3
    assert PrivacyLedger.from_state_dict(saved["ledger"]).epsilon == pytest.approx(eps[2])

    resumed = train_private(build_state(nn.Linear(6, 1), plan, config.private, seed=0), loss_fn, plan, config,
                            output=tmp_path, resume=True)
    # A ledger restarted at zero would take three more steps and end at the same ε while spending twice.
    assert resumed.stopped_by_budget and resumed.steps == 3 and resumed.reports == []
    assert resumed.epsilon == pytest.approx(eps[2])


def test_rule_6_a_resumed_run_continues_the_noise_instead_of_replaying_it(tmp_path):
    data = torch.randn(64, 6)

    def loss_fn(model, indices):
        return model(data[indices]).square().sum(-1)  # [b]

    plan = direct_plan(dataset_size=64, batch_size=16, sigma=1.0, clip=1.0, steps=4)
    config = tiny_config(**{"private.steps": 4, "private.checkpoint_every": 2})

    def fresh():
        torch.manual_seed(0)
        return build_state(nn.Linear(6, 1), plan, config.private, seed=0)  # the same seed every time

    straight = fresh()
    train_private(straight, loss_fn, plan, config)
    halfway = with_overrides(config, {"private.steps": 2})
    train_private(fresh(), loss_fn, plan, halfway, output=tmp_path)
    resumed = fresh()
    train_private(resumed, loss_fn, plan, config, output=tmp_path, resume=True)
    assert resumed.ledger.steps == 4
    assert torch.equal(flat_parameters(straight.model), flat_parameters(resumed.model))
    assert torch.equal(straight.noise.get_state(), resumed.noise.get_state())


def test_rule_6_delta_from_the_measured_size_and_a_calibrated_sigma_that_never_overspends(shards):
    from tasks.pretrain import _privacy_plan

    config = tiny_config(**{"privacy.noise_multiplier": None, "privacy.target_epsilon": 8.0, "private.steps": 20})
    plan = _privacy_plan(config, "private", sum(shard_counts(shards)[1]))
    assert plan["dataset_size"] == SHARD_IMAGES and plan["delta"] == 1 / (2 * SHARD_IMAGES)
    accounting = dict(sample_rate=plan["sample_rate"], steps=20, delta=plan["delta"], accountant="rdp")
    assert plan["planned_epsilon"] <= 8.0
    assert compute_epsilon(noise_multiplier=plan["noise_multiplier"], **accounting) <= 8.0
    assert compute_epsilon(noise_multiplier=plan["noise_multiplier"] * 0.99, **accounting) > 8.0


def test_rule_6_accountant_at_the_papers_rate_and_delta():
    n = 233_804_767
    q, delta = 98_304 / n, 1 / (2 * n)  # q ≈ 4.2e-4, δ ≈ 2.1e-9
    pld = compute_epsilon(noise_multiplier=0.4568, sample_rate=q, steps=6_000, delta=delta, accountant="pld")
    rdp = compute_epsilon(noise_multiplier=0.4568, sample_rate=q, steps=6_000, delta=delta, accountant="rdp")
    assert 7.9 < pld <= 8.0 < rdp  # PLD tight, RDP a looser upper bound
    assert compute_epsilon(noise_multiplier=0.4568, sample_rate=q, steps=5_999, delta=delta) < pld


# ------------------------------------------------------------------------------------------------ rule 7


def test_rule_7_users_are_told_the_guarantee_covers_the_pretraining_data_only():
    privacy_doc = " ".join((REPO / "docs" / "privacy.md").read_text().lower().split())
    readme = " ".join((REPO / "README.md").read_text().lower().split())
    assert "pre-training data only" in privacy_doc and "public" in privacy_doc
    assert "private pre-training data only" in readme and "evaluation data sets are treated as public" in readme
    assert "public" in (EvaluationConfig.__doc__ or "").lower()
