"""The DP engine against a one-sample-at-a-time reference: exact clipped sums, padding, noise, refusals."""

from __future__ import annotations

import collections
import gc
import logging
import math
import re
import threading
import time
import weakref

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torch.distributions import ContinuousBernoulli
from torch.nn import functional as F

from vip_core.config import get_preset
from vip_core.models.mae import build_mae
from vip_core.privacy import engine, layout, numerics, per_sample
from vip_core.privacy.engine import DPEngine, UnsupportedLayerError, plan_model, privatized_gradients
from vip_core.privacy.randomness import GaussianDraw, RandomStream


def reference_clipped_sum(model, loss_fn, inputs, max_grad_norm):
    """Σᵢ clip(gᵢ, C) computed one sample at a time with plain autograd."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    size = next(iter(inputs.values())).shape[0] if isinstance(inputs, dict) else inputs.shape[0]
    for i in range(size):
        one = {k: v[i : i + 1] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[i : i + 1]
        grads = torch.autograd.grad(loss_fn(model, one).sum(), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        factor = min(1.0, max_grad_norm / norm) if norm > 0 else 1.0
        for acc, g in zip(total, grads):
            acc += factor * g.double()
    return total


def engine_grads(model, loss_fn, inputs, max_grad_norm, expected=1.0, physical=None):
    privatized_gradients(
        model, loss_fn, inputs, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
        expected_batch_size=expected, physical_batch_size=physical,
    )
    return [p.grad.double() for p in model.parameters() if p.requires_grad]


def hand_every_task_to_helpers(monkeypatch, idle=None):
    """The engine sees ``idle`` idle cores (as many as torch's threads when None) and hands over work of any size."""
    monkeypatch.setattr(engine, "idle_cores", lambda: torch.get_num_threads() if idle is None else idle)
    monkeypatch.setattr(engine, "SPREAD_MIN_WORK", 0)
    monkeypatch.setattr(engine, "EARLY_MIN_ELEMENTS", 0)


def assert_matches_reference(model, loss_fn, inputs, max_grad_norm, physical=None):
    expected = reference_clipped_sum(model, loss_fn, inputs, max_grad_norm)
    got = engine_grads(model, loss_fn, inputs, max_grad_norm, physical=physical)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    scale = max(float(e.abs().max()) for e in expected)
    for name, e, g in zip(names, expected, got):
        assert torch.allclose(g, e, atol=1e-5 * scale, rtol=1e-4), f"{name}: max err {float((g - e).abs().max())}"


# ------------------------------------------------------------------------------------------------ models


class MixedNet(nn.Module):
    """Conv (padding, stride, dilation, groups, reflect padding), in-place ReLU, LayerNorm, a Linear called
    twice, a plain token owned by a child module, a 2-D Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, stride=2)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=4, padding_mode="reflect")
        self.relu = nn.ReLU(inplace=True)
        self.norm = nn.LayerNorm(8)
        self.shared = nn.Linear(8, 8)
        self.tokens = nn.Module()
        self.tokens.bias_token = nn.Parameter(torch.randn(1, 1, 8) * 0.1)
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv1(x))  # x: [N, 8, 4, 4]
        x = self.conv2(x).flatten(2).transpose(1, 2)  # x: [N, 16, 8]
        x = self.norm(x) + self.tokens.bias_token
        x = self.shared(torch.tanh(self.shared(x)))  # x: [N, 16, 8]
        return self.head(x.mean(1))  # [N, 4]


class TokenNet(nn.Module):
    """Embedding with padding_idx and repeated indices into a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=0)
        self.out = nn.Linear(6, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(tokens))).sum((1, 2))  # [N]


def classification_loss(model, inputs):
    return F.cross_entropy(model(inputs["x"]), inputs["y"], reduction="none")


def tiny_vit() -> VisionTransformer:
    return VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=3)


def mae_loss(model, inputs):
    return model(inputs["imgs"], noise=inputs["noise"])[0]


def tiny_mae():
    return build_mae(get_preset("tiny").model)


def mae_inputs(n: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"imgs": torch.randn(n, 3, 32, 32, generator=gen), "noise": torch.rand(n, 64, generator=gen)}


def vit_inputs(n: int) -> dict:
    return {"x": torch.randn(n, 3, 16, 16), "y": torch.randint(0, 3, (n,))}


# ------------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("materialise", [None, True, False], ids=["auto", "materialise", "ghost"])
def test_timm_vit_gives_the_exact_clipped_sum(monkeypatch, materialise):
    if materialise is not None:
        monkeypatch.setattr(per_sample, "materialise_is_cheaper", lambda *_: materialise)
    torch.manual_seed(0)
    assert_matches_reference(tiny_vit(), classification_loss, vit_inputs(6), max_grad_norm=0.05, physical=4)


def test_mae_gives_the_exact_clipped_sum_with_its_tokens():
    torch.manual_seed(0)
    mae = tiny_mae()
    trainable = {n for n, p in mae.named_parameters() if p.requires_grad}
    assert {"cls_token", "mask_token"} <= trainable
    assert_matches_reference(mae, mae_loss, mae_inputs(5), max_grad_norm=0.5, physical=3)


@pytest.mark.parametrize("materialise", [True, False], ids=["materialise", "ghost"])
def test_conv_layernorm_shared_linear_and_child_token(monkeypatch, materialise):
    monkeypatch.setattr(per_sample, "materialise_is_cheaper", lambda *_: materialise)
    torch.manual_seed(0)
    inputs = {"x": torch.randn(5, 3, 8, 8), "y": torch.randint(0, 4, (5,))}
    assert_matches_reference(MixedNet(), classification_loss, inputs, max_grad_norm=0.1)


def test_layernorms_with_zero_small_and_float64_weights_give_the_exact_clipped_sum():
    """The weight gradient comes from the input normalised again, whatever the weight: zero, tiny beside the bias,
    or a float64 weight float32 cannot hold."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 1))
    with torch.no_grad():
        model[3].weight.copy_(torch.tensor([1.0, 0.0, 1e-4, 2.0, -1.0, 0.5]))
        model[3].bias.fill_(1.0)
    assert_matches_reference(model, lambda m, x: m(x).sum((1, 2)), torch.randn(6, 3, 5), 0.3)
    wide = nn.Sequential(nn.Linear(4, 4).double(), nn.LayerNorm(4, bias=False).double())
    with torch.no_grad():
        wide[1].weight.fill_(1e-50)
    loss = lambda m, x: (m(x) * torch.arange(1.0, 5.0, dtype=torch.float64)).sum((1, 2))  # noqa: E731
    assert_matches_reference(wide, loss, torch.randn(5, 3, 4, dtype=torch.float64), 0.5)


def test_embedding_with_padding_and_repeated_indices():
    torch.manual_seed(0)
    tokens = torch.tensor([[1, 1, 2, 0], [3, 0, 0, 3], [4, 5, 6, 7], [2, 2, 2, 2]])
    assert_matches_reference(TokenNet(), lambda m, t: m(t), tokens, max_grad_norm=0.2)


def test_linear_on_two_and_four_dimensional_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.GELU(), nn.Linear(6, 2))
    flat, deep = torch.randn(4, 5), torch.randn(4, 3, 2, 5)
    assert_matches_reference(model, lambda m, x: m(x).sum(-1), flat, max_grad_norm=0.3)
    assert_matches_reference(model, lambda m, x: m(x).flatten(1).sum(-1), deep, max_grad_norm=0.3)


def test_layers_of_one_shape_computed_together_give_each_its_own_clipped_sum(monkeypatch):
    """A ViT's blocks form groups of layers of one shape, stacked once; each layer's weight and bias must still get
    its own sum (a group's rows added in order, or through an index where its parameters are not consecutive)."""
    groups = []
    matmul_group = per_sample.matmul_group
    monkeypatch.setattr(per_sample, "matmul_group", lambda layers, *a: groups.append(len(layers)) or
                        matmul_group(layers, *a))
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=4, num_classes=3)
    assert_matches_reference(vit, classification_loss, vit_inputs(5), max_grad_norm=0.05)
    assert max(groups) == 3  # the three blocks' qkv (and proj, fc1, fc2) layers in one group each


class SameSizesOtherShapes(nn.Module):
    """Layers whose kept tensors have one shape but whose weights have others: a Linear [3, 4] beside a 1 x 1 Conv2d
    [3, 4, 1, 1], a LayerNorm (6,) beside a LayerNorm (2, 3), and Conv2d kernels (1, 2) and (2, 2) reading 8 values."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.lin = nn.Conv2d(4, 3, 1, bias=False), nn.Linear(4, 3, bias=False)
        self.flat, self.square = nn.LayerNorm(6), nn.LayerNorm((2, 3))
        self.wide, self.tall = nn.Conv2d(4, 3, (1, 2), stride=(1, 2)), nn.Conv2d(2, 3, 2, stride=2)

    def forward(self, x):  # x: [B, 4, 2, 4]
        pixels = x[:, :, :, :2]  # [B, 4, 2, 2]
        first = self.conv(pixels).flatten(1) + self.lin(pixels.flatten(2).transpose(1, 2)).transpose(1, 2).flatten(1)
        rows = x.reshape(-1, 4, 8)[:, :, :6]  # [B, 4, 6]
        second = (self.flat(rows) * rows).sum((1, 2)) + (self.square(rows.view(-1, 4, 2, 3)) * rows.view(-1, 4, 2, 3)).sum((1, 2, 3))
        third = self.wide(x).sum((1, 2, 3)) + self.tall(x[:, :2].repeat(1, 1, 2, 1)).sum((1, 2, 3))
        return first.sum(1) + second + third  # [B]


@pytest.mark.parametrize("materialise", [True, False], ids=["materialise", "ghost"])
def test_layers_whose_weights_differ_in_shape_are_never_summed_as_one_group(monkeypatch, materialise):
    """Grouped by their kept tensors' shapes alone, two such layers shared one row of the gradient buffer: one got both
    clipped sums, the other none, and removing a sample moved the sum by up to √2·C (the review of 6 December)."""
    monkeypatch.setattr(per_sample, "materialise_is_cheaper", lambda *_: materialise)
    torch.manual_seed(0)
    assert_matches_reference(SameSizesOtherShapes(), lambda m, x: m(x), torch.randn(5, 4, 2, 4), max_grad_norm=0.5)


def test_microbatches_are_padded_to_the_physical_size_and_the_result_does_not_change():
    torch.manual_seed(0)
    vit, inputs = tiny_vit(), vit_inputs(7)
    seen = []

    def loss(model, batch):
        seen.append(batch["x"].shape[0])
        return classification_loss(model, batch)

    whole = engine_grads(vit, classification_loss, inputs, 0.05)
    for physical in (1, 3, 4, 10):
        seen.clear()
        parts = engine_grads(vit, loss, inputs, 0.05, physical=physical)
        assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(whole, parts))
        assert set(seen[-math.ceil(7 / physical):]) == {physical}  # every training forward of one shape


def test_padded_rows_are_exactly_zero_in_every_norm_and_factor(monkeypatch):
    """The padding copies the microbatch's first sample with loss weight 0: its output gradients, norms and clip
    factors are exactly 0, so it adds exactly nothing to the sums."""
    seen = []
    clip_factors = numerics.clip_factors

    def spy(values, max_grad_norm, real):
        factors, non_finite = clip_factors(values, max_grad_norm, real)
        seen.append((values.clone(), factors.clone(), real.clone()))
        return factors, non_finite

    monkeypatch.setattr(numerics, "clip_factors", spy)
    torch.manual_seed(0)
    model, inputs = MixedNet(), torch.randn(5, 3, 8, 8)
    engine_grads(model, lambda m, x: m(x).sum(-1), inputs, 0.5, physical=4)
    values, factors, real = seen[-1]  # the second microbatch: 1 sample and 3 copies of it
    assert real.tolist() == [True, False, False, False]
    assert factors[0] > 0 and bool((factors[1:] == 0).all())
    assert bool((values[0, 1:] == 0).all()) and bool((values[0, :1] > 0).all())


def test_groups_spread_over_idle_cores_give_bit_identical_gradients(monkeypatch):
    """On a CPU whose torch threads leave a core idle, groups' norms and sums are shared with a helper thread: the
    same values, since the groups are independent and their norms are added in order."""
    torch.manual_seed(0)
    model, inputs = MixedNet(), torch.randn(5, 3, 8, 8)
    inputs[3, 0, 0, 0] = float("inf")
    previous = torch.get_num_threads()
    runs = []
    try:
        torch.set_num_threads(1)
        for idle in (0, 1):
            hand_every_task_to_helpers(monkeypatch, idle)
            runs.append(engine_grads(model, lambda m, x: m(x).sum(-1), inputs, 0.5, physical=2))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_step_that_hands_layers_over_during_the_backward_lets_its_graph_and_inputs_go(monkeypatch):
    """The hand-over listens on the autograd graph's nodes: the step must not keep them (and the activations they
    hold) alive once it is done, or every step would leak its graph."""
    hand_every_task_to_helpers(monkeypatch)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    inputs = torch.randn(3, 4)
    kept = weakref.ref(inputs)  # the first Linear's backward node holds it for its weight gradient
    engine_grads(model, lambda m, x: m(x).sum(-1), inputs, 0.5)
    del inputs
    assert kept() is None


@pytest.mark.parametrize("build, loss_fn, inputs", [
    (tiny_mae, mae_loss, mae_inputs(5)),
    (MixedNet, lambda m, x: m(x).sum(-1), torch.randn(5, 3, 8, 8)),
    (TokenNet, lambda m, t: m(t), torch.tensor([[0, 3, 3, 5], [2, 2, 0, 9], [1, 4, 4, 4], [7, 0, 0, 7], [3, 1, 3, 1]])),
], ids=["mae", "mixed", "embedding"])
def test_layers_handed_to_an_idle_core_during_the_backward_give_the_exact_clipped_sum(monkeypatch, build, loss_fn,
                                                                                       inputs):
    """Where a core is idle, layers whose gradients have all arrived are computed on a helper thread while the
    backward goes on: the clipped sum is still the one-at-a-time reference's, padding included."""
    torch.manual_seed(0)
    model = build()
    handed = []

    def spied(engine_, records, *rest):
        handed.append(threading.current_thread() is not threading.main_thread())
        return computed(engine_, records, *rest)

    computed = engine._computed
    monkeypatch.setattr(engine, "_computed", spied)
    hand_every_task_to_helpers(monkeypatch)
    assert_matches_reference(model, loss_fn, inputs, max_grad_norm=0.05, physical=3)
    assert handed and all(handed)


def test_where_the_users_float32_matmuls_are_not_ieee_no_layer_is_handed_over_during_the_backward(monkeypatch):
    """The helper's IEEE float32 settings are the process's: set during the backward, they would change the precision
    of the user's backward, and with it the gradients, from run to run."""
    handed, listening = [], engine._EarlyGroups

    def recorded(*args):
        handed.append(args)
        return listening(*args)

    monkeypatch.setattr(engine, "_EarlyGroups", recorded)
    monkeypatch.setattr(engine, "idle_cores", lambda: torch.get_num_threads())
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        engine_grads(tiny_mae(), mae_loss, mae_inputs(3), 0.05)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert handed == []
    engine_grads(tiny_mae(), mae_loss, mae_inputs(3), 0.05)
    assert len(handed) == 1  # the same step, under torch's default precision


def test_every_parameter_kind_is_scaled_by_the_one_flat_factor():
    torch.manual_seed(0)
    mae, inputs = tiny_mae(), mae_inputs(1)
    params = [p for p in mae.parameters() if p.requires_grad]
    raw = torch.autograd.grad(mae_loss(mae, inputs).sum(), params)
    norm = math.sqrt(sum(float(g.square().sum()) for g in raw))
    clip = norm / 10
    got = engine_grads(mae, mae_loss, inputs, clip)
    assert math.sqrt(sum(float(g.square().sum()) for g in got)) == pytest.approx(clip, rel=1e-4)
    for (name, _), g, r in zip([(n, p) for n, p in mae.named_parameters() if p.requires_grad], got, raw):
        if float(r.abs().max()) > 0:
            assert torch.allclose(g, r.double() / 10, rtol=1e-3, atol=1e-9 * norm), name


def test_divides_by_the_expected_not_the_realised_batch_size():
    torch.manual_seed(0)
    vit, inputs = tiny_vit(), vit_inputs(3)
    summed = engine_grads(vit, classification_loss, inputs, 0.05, expected=1.0)
    divided = engine_grads(vit, classification_loss, inputs, 0.05, expected=10.0)
    assert all(torch.allclose(d * 10, s, atol=1e-9) for d, s in zip(divided, summed))


@pytest.mark.parametrize("physical", [None, 2])
def test_a_sample_with_a_non_finite_gradient_contributes_nothing(physical):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 1))
    x = torch.randn(4, 4)
    bad = x.clone()
    bad[2] = float("inf")
    loss = lambda m, b: m(b).sum(-1)  # noqa: E731
    with_bad = engine_grads(model, loss, bad, 0.5, physical=physical)
    without = engine_grads(model, loss, x[[0, 1, 3]], 0.5)
    assert all(torch.isfinite(g).all() and torch.allclose(g, w, atol=1e-7) for g, w in zip(with_bad, without))
    stats = privatized_gradients(model, loss, bad, max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=1.0,
                                 physical_batch_size=physical)
    assert (stats.examples, stats.non_finite) == (4, 1)


class LeaksNonFiniteRows(nn.Module):
    """Adds 0 × the next row to each row: nothing for finite data (the layout check sees no mixing), NaN beside a
    non-finite row, as oneDNN's bfloat16 matmuls do on some CPUs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):  # x: [B, 4]
        beside = torch.cat([x[1:], x[:1]]) * 0.0  # [B, 4]
        return self.fc(x + beside).sum(-1)


def test_a_non_finite_sample_spread_into_its_neighbours_does_not_drop_them():
    """One NaN sample must not make its neighbours' norms NaN and drop them."""
    torch.manual_seed(0)
    model, x = LeaksNonFiniteRows(), torch.randn(5, 4)
    bad = x.clone()
    bad[2, 1] = float("nan")
    with_bad = engine_grads(model, lambda m, b: m(b), bad, 0.5, physical=4)
    without = reference_clipped_sum(model, lambda m, b: m(b), x[[0, 1, 3, 4]], 0.5)
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(with_bad, without))


class OverflowsOnItsLastRow(nn.Module):
    """Scales its last row by 1e38 twice: the padding row of a padded microbatch overflows, as a padding copy can
    under per-sample randomness (dropout) while the sample it copies does not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):  # x: [B, 4]
        scale = torch.ones(x.shape[0], 1)
        scale[-1] = 1e38
        return self.fc(x * scale * scale).sum(-1)


def test_a_padding_row_that_overflows_leaves_the_sum_finite():
    """A padding row's factor 0 times its infinite gradient must not make the whole step NaN."""
    torch.manual_seed(0)
    model, x = OverflowsOnItsLastRow(), torch.randn(3, 4)
    padded = engine_grads(model, lambda m, b: m(b), x, 0.5, physical=4)
    assert all(torch.isfinite(g).all() for g in padded)


def test_the_statistics_count_the_samples_and_the_clipped_ones_but_not_the_padding():
    torch.manual_seed(0)
    vit, inputs = tiny_vit(), vit_inputs(5)
    stats = privatized_gradients(vit, classification_loss, inputs, max_grad_norm=1e-6, noise_multiplier=0.0,
                                 expected_batch_size=5.0, physical_batch_size=4)
    losses = classification_loss(vit, inputs).detach()
    assert (stats.examples, stats.clipped, stats.non_finite) == (5, 5, 0)
    assert stats.loss_sum == pytest.approx(float(losses.sum()), rel=1e-5)
    assert 0 <= stats.shortfall < 1e-3  # float32 throughout: the bounds scale a clipped sample by far less


# ------------------------------------------------------------------------------------------------ precision


def bf16_loss(loss_fn):
    def loss(model, inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(model, inputs).float()

    return loss


class ConvNet(nn.Module):
    """Every supported layer kind under autocast: a patch-cutting Conv2d, a grouped Conv2d, LayerNorm, an Embedding
    and a plain token, Linear layers ghost-normed (many tokens) and materialised (few)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 4, stride=4)
        self.grouped = nn.Conv2d(16, 16, 3, padding=1, groups=2)
        self.norm = nn.LayerNorm(16)
        self.embed = nn.Embedding(5, 16)
        self.token = nn.Parameter(torch.randn(1, 1, 16))
        self.wide = nn.Linear(16, 64)
        self.head = nn.Linear(64, 2)

    def forward(self, inputs):  # images [B, 3, 16, 16], labels [B]
        images, labels = inputs
        x = self.grouped(self.patch(images)).flatten(2).transpose(1, 2)  # x: [B, 16, 16]
        x = self.norm(x + self.embed(labels).unsqueeze(1) + self.token)
        return self.head(torch.tanh(self.wide(x)).mean(1)).square().sum(1)  # [B]


def leave_one_out(model, loss_fn, inputs, clip, removed, strict=False):
    """‖S(D) − S(D without sample ``removed``)‖ of the clipped sums (noise off), over every parameter."""
    sums = []
    for batch in (inputs, tuple(torch.cat([t[:removed], t[removed + 1:]]) for t in inputs)):
        privatized_gradients(model, loss_fn, batch, max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=1,
                             physical_batch_size=4, strict_float32=strict)
        sums.append(torch.cat([p.grad.double().flatten() for p in model.parameters()]))
    return float((sums[0] - sums[1]).norm())


@pytest.mark.parametrize("strict", [False, True], ids=["bf16-operands", "strict"])
def test_under_bf16_removing_a_sample_moves_the_clipped_sum_by_at_most_c(strict):
    """Rule 12: every layer kind under bfloat16 autocast, with one sample's gradient a thousand times the others' (so
    that it is clipped hard): its contribution, rounded as summed, stays within C."""
    torch.manual_seed(0)
    model = ConvNet()
    images, labels = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
    images[2] *= 1000.0
    loss = bf16_loss(lambda m, x: m(x))
    for removed in (0, 2, 5):
        assert leave_one_out(model, loss, (images, labels), 0.01, removed, strict) <= 0.01 * (1 + 1e-5)


def aligned_tokens_loss(model, inputs):
    """Every token of a sample carries the same activation and the same output gradient, so that the rounding of the
    scaled operand adds up across the tokens instead of cancelling."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return (model(inputs[0]).float() * inputs[1]).sum((1, 2))  # [B]


def test_the_margin_keeps_a_coherently_rounded_contribution_within_c(monkeypatch):
    """64 equal tokens of ones, and their norm N = 512: a clip factor just above the midpoint between two bfloat16
    numbers rounds every entry of the scaled operand up by almost 2^-8. Without the margin for that rounding the
    contribution exceeds C; with it, it stays within."""
    monkeypatch.setattr(per_sample, "materialise_is_cheaper", lambda *_: False)
    layer = nn.Linear(8, 8, bias=False)
    ones = torch.ones(2, 64, 8)
    clip = 512 * (1 + 2.0**-8 + 2.0**-12) * 2.0**-10

    def contribution() -> float:
        numerics._ghost_weights.cache_clear()
        privatized_gradients(layer, aligned_tokens_loss, (ones, ones), max_grad_norm=clip, noise_multiplier=0.0,
                             expected_batch_size=1)
        return float(layer.weight.grad.double().norm() / 2)  # the two samples are the same

    with_margin = contribution()
    monkeypatch.setattr(numerics.Numerics, "scaled_roundoff", lambda self, dtype: 0.0)
    without = contribution()
    numerics._ghost_weights.cache_clear()
    assert with_margin <= clip < without


def test_the_ghost_bounds_are_never_below_the_exact_errors():
    """Random rows with cancelling tokens of very different sizes, in bfloat16: the computed ghost norm plus its bound
    is at least the exact norm, and the margin at least the exact rounding error of the operand each row scales."""
    torch.manual_seed(0)
    scales = torch.logspace(-3, 3, 12).view(1, 12, 1)
    acts = (torch.randn(8, 12, 24) * scales).bfloat16()
    grads = (torch.randn(8, 12, 40) * scales.flip(1)).bfloat16()
    grads[:, 1] = -grads[:, 0]  # two tokens whose contributions cancel
    numbers = numerics.Numerics(strict=False, tensor_cores=False, accumulation=numerics.TENSOR_CORE_ROUNDOFF)
    act_gram, grad_gram = numbers.bmm(acts, acts.mT), numbers.bmm(grads, grads.mT)
    token_norms = torch.stack([torch.linalg.vector_norm(acts, dim=2, dtype=torch.float32),
                               torch.linalg.vector_norm(grads, dim=2, dtype=torch.float32)])
    terms, scales_acts = numerics.ghost_terms(act_gram, grad_gram, token_norms, 24, 40, numbers,
                                              (torch.bfloat16, torch.bfloat16))
    exact = torch.bmm(grads.double().mT, acts.double()).flatten(1).norm(dim=1)  # [N]
    assert bool((terms[1].sqrt() >= exact).all())
    factor = 0.37
    for row in range(8):
        a, g = acts[row].double(), grads[row].double()
        if scales_acts[row]:
            rounded = (acts[row].float() * factor).bfloat16().double()
            error = float((g.mT @ (rounded - factor * a)).norm())
        else:
            rounded = (grads[row].float() * factor).bfloat16().double()
            error = float(((rounded - factor * g).mT @ a).norm())
        assert error <= factor * float(terms[2, row].sqrt()) + float(terms[3, row])


def test_materialised_squares_folded_once_bound_every_pieces_exact_squares_and_a_count_beyond_reach_is_refused():
    """Pieces of float32 entries of very different sizes, gathered in one Norms (two of them merged, as groups
    computed apart are): the folded U² is at least the exact float64 sum of the exact squares, the computed row is
    the float64 sum of the float32 squares; and the bound refuses more entries than its slack covers."""
    torch.manual_seed(0)
    pieces = [torch.randn(3, 4, n) * scale for n, scale in ((5, 1e-3), (700, 1.0), (33, 1e4))]  # [L, B, n] each
    norms, group = per_sample.Norms(4, torch.device("cpu")), per_sample.Norms(4, torch.device("cpu"))
    per_sample.piece([], pieces[0], norms, lambda params, values: None)
    for values in pieces[1:]:
        per_sample.piece([], values, group, lambda params, values: None)
    norms.merge(group)
    assert group.squares is None  # given up to the accumulator it was merged into
    norms.fold_squares()
    exact = sum((values.double() ** 2).sum((0, 2)) for values in pieces)  # [B]
    computed = sum((values * values).double().sum((0, 2)) for values in pieces)
    assert torch.allclose(norms.values[0], computed, rtol=1e-15, atol=0)
    assert bool((norms.values[1] >= exact).all()) and bool((norms.values[1] <= exact * (1 + 2.0**-21)).all())
    with pytest.raises(ValueError, match="beyond the rounding bound's reach"):
        numerics.squares_bound(exact, numerics.MAX_SQUARED_TERMS + 1)


def test_the_probe_passes_ieee_float32_and_catches_a_coarser_accumulator():
    cpu = torch.device("cpu")
    assert numerics.probe_matrix_units(numerics.CPU_MIXED.bmm, cpu, numerics.TENSOR_CORE_ROUNDOFF) is None
    bfloat16_output = lambda a, b: torch.bmm(a, b).float()  # noqa: E731  (rounds every result to 8 bits)
    assert "erred by" in numerics.probe_matrix_units(bfloat16_output, cpu, numerics.TENSOR_CORE_ROUNDOFF)

    def truncating(a, b, bits=20):
        """The diagonal of each product (all that the probe reads; 0 elsewhere), its products added one by one in
        float64, keeping ``bits`` bits after the leading one (rounding toward zero) after each addition."""
        size = min(a.shape[1], b.shape[2])
        products = a[:, :size].double() * b[:, :, :size].double().mT  # the diagonals' products: [n, size, K]
        total = torch.zeros(products.shape[:2], dtype=torch.float64)  # [n, size]
        for k in range(products.shape[2]):
            total += products[:, :, k]
            exponent = torch.frexp(total).exponent  # |total| = m·2^e with 1/2 <= m < 1
            quantum = torch.ldexp(torch.ones_like(total), exponent - 1 - bits)
            total = torch.trunc(total / quantum) * quantum
        got = torch.zeros(a.shape[0], a.shape[1], b.shape[2])
        got.diagonal(dim1=1, dim2=2).copy_(total)
        return got

    assert "erred by" in numerics.probe_matrix_units(truncating, cpu, numerics.TENSOR_CORE_ROUNDOFF)
    assert numerics.probe_matrix_units(lambda a, b: truncating(a, b, 22), cpu, numerics.TENSOR_CORE_ROUNDOFF) is None
    for rows, alone in ((1, True), (1, False), (128, True), (128, False)):
        # a device that truncates in its kernel for one of the shapes only is caught by that shape
        def one_kernel(a, b, rows=rows, alone=alone):
            picked = a.shape[1] == rows and (a.shape[0] == 1) == alone
            return truncating(a, b) if picked else numerics.CPU_MIXED.bmm(a, b)

        failure = numerics.probe_matrix_units(one_kernel, cpu, numerics.TENSOR_CORE_ROUNDOFF)
        assert "erred by" in failure and f"[{rows}, " in failure and ("in a batch of 1 " in failure) == alone
    not_a_number = lambda a, b: torch.full((a.shape[0], a.shape[1], b.shape[2]), math.nan)  # noqa: E731
    assert "erred by nan" in numerics.probe_matrix_units(not_a_number, cpu, numerics.TENSOR_CORE_ROUNDOFF)


def test_the_probe_multiplies_in_the_shapes_of_the_engines_grams():
    """A library picks its kernel by shape, batch count included: the probe multiplies each length's dot products
    alone and batched (the Grams of one token per sample) and in 128-row products, alone and batched (the Grams of
    many tokens)."""
    shapes = []

    def recording(a, b):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return numerics.CPU_MIXED.bmm(a, b)

    assert numerics.probe_matrix_units(recording, torch.device("cpu"), numerics.TENSOR_CORE_ROUNDOFF) is None
    lengths = {left[2] for left, _ in shapes}
    assert lengths >= {2, 1024, 4096}
    for rows, batched in ((1, False), (1, True), (128, False), (128, True)):  # one token per sample, or many
        assert {left[2] for left, right in shapes if left[1] == right[2] == rows and (left[0] > 1) == batched} \
            == lengths, (rows, batched)


def test_a_device_whose_tensor_cores_fail_the_probe_falls_back_to_ieee_float32_with_a_warning(monkeypatch):
    monkeypatch.setattr(numerics, "_probe_once", lambda device: "a dot product of 2 terms erred by 1e-06")
    with pytest.warns(UserWarning, match="IEEE float32 instead"):
        assert numerics.numerics_for(torch.device("cuda", 0), strict=False) is numerics.IEEE
    monkeypatch.setattr(numerics, "_probe_once", lambda device: None)
    assert numerics.numerics_for(torch.device("cuda", 0), strict=False) is numerics.TENSOR_CORES
    assert numerics.numerics_for(torch.device("cuda", 0), strict=True) is numerics.IEEE
    assert numerics.numerics_for(torch.device("cpu"), strict=False) is numerics.CPU_MIXED


def test_under_autocast_a_layers_input_is_kept_in_the_autocast_dtype():
    """The engine casts a float32 input to bfloat16 before the layer, as autocast would: the layer computes the same
    output and the rule keeps the operand the layer multiplied (not a float32 copy, twice the memory)."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    x = torch.randn(3, 5, 8)
    kept = []
    matmul_group = per_sample.matmul_group

    def spy(layers, acts, grads, *rest):
        kept.extend(a.dtype for a in acts + grads)
        return matmul_group(layers, acts, grads, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(per_sample, "matmul_group", spy)
        privatized_gradients(layer, lambda m, x: bf16_loss(lambda m, x: m(x).sum((1, 2)))(m, x), x,
                             max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1)
    assert kept == [torch.bfloat16, torch.bfloat16]


def test_ieee_float32_holds_while_any_thread_is_inside_and_then_restores_the_users_setting():
    import threading

    matmuls = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    before = torch.get_float32_matmul_precision(), [backend.fp32_precision for backend in matmuls]
    torch.set_float32_matmul_precision("high")  # the legacy API, as most users turn TF32 on
    user = [backend.fp32_precision for backend in matmuls]
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with numerics.ieee_float32():
            a_inside.set()
            b_inside.wait()
        a_left.set()

    def second():
        a_inside.wait()
        with numerics.ieee_float32():
            b_inside.set()
            a_left.wait()
            seen["inside"] = [backend.fp32_precision for backend in matmuls]
            seen["tf32"] = torch._C._get_cublas_allow_tf32()

    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert seen == {"inside": ["ieee", "ieee"], "tf32": False}
        assert [backend.fp32_precision for backend in matmuls] == user
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before[0])
        for backend, value in zip(matmuls, before[1]):
            backend.fp32_precision = value


def test_with_torchs_per_backend_bfloat16_setting_the_norms_run_in_ieee_float32_and_the_setting_is_kept(monkeypatch):
    """``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` (torch's newer API) leaves the legacy precision
    without a value, which torch refuses to report: the step still runs, its norms in IEEE float32, and the user's
    setting is theirs again after it."""
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    seen = []

    def clip_factors(*args, **kwargs):
        seen.append(matmul.fp32_precision)
        return factors(*args, **kwargs)

    factors = numerics.clip_factors
    monkeypatch.setattr(numerics, "clip_factors", clip_factors)
    try:
        matmul.fp32_precision = "bf16"
        torch.manual_seed(0)
        model, inputs = tiny_vit(), vit_inputs(4)
        got = engine_grads(model, classification_loss, inputs, 0.05)
        assert matmul.fp32_precision == "bf16"
    finally:
        matmul.fp32_precision = before
    assert seen == ["ieee"]
    expected = reference_clipped_sum(model, classification_loss, inputs, 0.05)  # its backward in IEEE float32
    assert all(torch.allclose(g, e, atol=1e-2 * float(e.abs().max()), rtol=1e-2) for g, e in zip(got, expected))


# ------------------------------------------------------------------------------------------------ noise


def test_empty_batch_gives_noise_with_std_sigma_c_over_b():
    model = nn.Linear(100, 200)
    sigma, clip, expected = 2.0, 0.5, 4.0
    privatized_gradients(
        model, lambda m, x: m(x).sum(-1), torch.empty(0, 100), max_grad_norm=clip, noise_multiplier=sigma,
        expected_batch_size=expected, noise=RandomStream(1, 0, "noise"),
    )
    noise = torch.cat([model.weight.grad.flatten(), model.bias.grad])
    assert noise.std().item() == pytest.approx(sigma * clip / expected, rel=0.03)
    assert abs(noise.mean().item()) < 0.03 * sigma * clip / expected


def test_noise_is_added_once_around_the_clipped_sum_and_follows_its_stream():
    torch.manual_seed(0)
    vit, inputs = tiny_vit(), vit_inputs(4)
    clean = engine_grads(vit, classification_loss, inputs, 0.05, expected=4.0)
    noisy = []
    for _ in range(2):
        privatized_gradients(
            vit, classification_loss, inputs, max_grad_norm=0.05, noise_multiplier=3.0, expected_batch_size=4.0,
            physical_batch_size=1, noise=RandomStream(7, 0, "noise"),
        )
        noisy.append(torch.cat([p.grad.flatten() for p in vit.parameters()]))
    assert torch.equal(noisy[0], noisy[1])
    residual = noisy[0].double() - torch.cat([c.flatten() for c in clean])
    assert residual.std().item() == pytest.approx(3.0 * 0.05 / 4.0, rel=0.05)


def test_the_gradients_are_one_flat_draw_divided_once_and_parameters_of_one_shape_are_consecutive():
    """One draw of the device's flat buffer (tensor 0), in the buffer's order (parameters grouped by shape), divided
    once by the expected batch size; float32 gradients are views of it, a float64 one a copy in its dtype."""
    model = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Linear(5, 5), nn.Linear(5, 2).double())
    privatized_gradients(model, lambda m, x: m[3](m[2](m[1](m[0](x))).double()).sum(-1), torch.empty(0, 3),
                         max_grad_norm=0.5, noise_multiplier=2.0, expected_batch_size=4.0,
                         noise=RandomStream(9, 0, "noise"))
    params = list(model.parameters())
    by_shape = [params[0], params[1], params[2], params[3], params[5], params[4], params[6], params[7]]
    flat = GaussianDraw(RandomStream(9, 0, "noise"), 1.0).tensor(0, (sum(p.numel() for p in params),)) / 4.0
    assert torch.equal(torch.cat([p.grad.double().flatten() for p in by_shape]), flat.double())
    assert len({p.grad.untyped_storage().data_ptr() for p in params if p.dtype == torch.float32}) == 1
    assert all(p.grad.dtype == p.dtype for p in params)


def test_a_private_step_keeps_its_plan_and_buffer_from_step_to_step(monkeypatch):
    calls = []
    monkeypatch.setattr(engine, "plan_model", lambda model: calls.append(model) or plan_model(model))
    torch.manual_seed(0)
    vit = tiny_vit()
    dp = DPEngine(vit, max_grad_norm=0.05)
    storages = set()
    for seed in range(3):
        clipped = dp.clipped_sum(noise_multiplier=1.0, noise=RandomStream(seed, 0, "noise"))
        clipped.add(classification_loss, vit_inputs(3), physical_batch_size=2)
        clipped.privatize(expected_batch_size=3.0)
        storages.add(vit.head.weight.grad.untyped_storage().data_ptr())
    assert len(calls) == 1 and len(storages) == 1


def test_a_privatized_or_failed_sum_refuses_to_go_on():
    model = nn.Linear(2, 1)
    dp = DPEngine(model, max_grad_norm=1.0)
    done = dp.clipped_sum()
    done.add(lambda m, x: m(x).sum(-1), torch.randn(2, 2))
    done.privatize(expected_batch_size=2.0)
    with pytest.raises(RuntimeError, match="privatized already"):
        done.add(lambda m, x: m(x).sum(-1), torch.randn(2, 2))
    failed = dp.clipped_sum(noise_multiplier=1.0, noise=RandomStream(1, 0, "noise"))

    def breaks(m, x):
        raise RuntimeError("the loss failed")

    with pytest.raises(RuntimeError, match="the loss failed"):
        failed.add(breaks, torch.randn(2, 2))
    with pytest.raises(RuntimeError, match="failed part-way"):
        failed.add(lambda m, x: m(x).sum(-1), torch.randn(2, 2))
    first = dp.clipped_sum()
    dp.clipped_sum()
    with pytest.raises(RuntimeError, match="given up for a newer sum"):
        first.privatize(expected_batch_size=1.0)


def test_a_layer_the_loss_does_not_reach_still_gets_its_noise():
    model = nn.ModuleDict({"used": nn.Linear(3, 1), "unused": nn.Linear(3, 1)})
    privatized_gradients(model, lambda m, x: m["used"](x).sum(-1), torch.randn(4, 3), max_grad_norm=1.0,
                         noise_multiplier=1.0, expected_batch_size=4.0, noise=RandomStream(2, 0, "noise"))
    assert bool((model["unused"].weight.grad != 0).all())


def test_mae_masks_are_independent_per_sample_across_microbatches():
    mae, masks = tiny_mae(), []

    def loss(model, imgs):
        losses, _, mask = model(imgs)
        masks.append(mask)
        return losses

    same_image = torch.randn(1, 3, 32, 32).expand(8, -1, -1, -1)
    privatized_gradients(
        mae, loss, same_image, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=8, physical_batch_size=4
    )
    rows = torch.cat(masks[-2:])  # the two training microbatches (the first calls are the layout check's)
    assert rows.shape == (8, 64)
    assert len({tuple(r.tolist()) for r in rows}) == 8


# ------------------------------------------------------------------------------------------------ refusals


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x)).mean((1, 2, 3))


class RowParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (x * self.scale).sum(-1)


class TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return F.linear(self.proj(x), self.proj.weight).sum(-1)


class SharedParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x)).sum(-1)


class RunningStatistics(nn.Module):
    """An InstanceNorm that tracks running statistics: its buffers, computed from private images without noise,
    would be published with the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.InstanceNorm2d(4, track_running_stats=True)

    def forward(self, x):
        return self.norm(self.conv(x)).mean((1, 2, 3))


class TokenAlsoABuffer(nn.Module):
    """A plain ``[1, 1, D]`` parameter that a submodule also holds as a buffer and uses: that use bypasses the
    parameter's per-sample stand-in."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, 4))
        self.proj = nn.Linear(4, 4)
        self.proj.register_buffer("alias", self.token)

    def forward(self, x):  # x: [B, T, 4]
        return (self.proj(x + self.token) * self.proj.alias).sum((1, 2))  # [B]


@pytest.mark.parametrize(
    ("model", "inputs", "named"),
    [
        (WithBatchNorm(), torch.randn(2, 3, 5, 5), "layer 'bn' .BatchNorm2d. mixes the samples"),
        (RowParameter(), torch.randn(2, 4), r"'scale' \[4\]"),
        (TiedHead(), torch.randn(2, 4), "a parameter of 'proj' reaches the loss 2 time"),
        (SharedParameter(), torch.randn(2, 4), "'b.weight' is the same tensor as 'a.weight'"),
        (RunningStatistics(), torch.randn(2, 3, 5, 5), "buffer 'norm.running_mean', .* changed while training"),
        (TokenAlsoABuffer(), torch.randn(3, 2, 4), "a parameter of 'token' reaches the loss 1 time"),
        (nn.MultiheadAttention(4, 2), torch.randn(2, 3, 4), "'in_proj_weight'"),
    ],
    ids=["batchnorm", "row-parameter", "tied-weight", "shared-parameter", "running-statistics", "token-as-buffer",
         "multihead-attention"],
)
def test_unsupported_models_are_refused_naming_the_part(model, inputs, named):
    def loss(m, x):
        return m(x, x, x)[0].sum((0, 2)) if isinstance(m, nn.MultiheadAttention) else m(x)

    with pytest.raises(UnsupportedLayerError, match=named):
        privatized_gradients(model, loss, inputs, max_grad_norm=1.0, noise_multiplier=1.0,
                             expected_batch_size=2, noise=RandomStream(1, 0, "noise"))


class ReassignsItsStatistics(nn.Module):
    """Keeps a running mean of its input by assigning a new tensor to its buffer (not in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.register_buffer("running_mean", torch.zeros(4))

    def forward(self, x):
        hidden = self.fc(x)
        if self.training:
            self.running_mean = 0.9 * self.running_mean + 0.1 * hidden.detach().mean((0, 1))
        return hidden.sum((1, 2))


def test_statistics_kept_by_reassigning_a_buffer_are_refused():
    with pytest.raises(UnsupportedLayerError, match="buffer 'running_mean' changed while training on private data"):
        engine_grads(ReassignsItsStatistics(), lambda m, x: m(x), torch.randn(4, 2, 3), 1.0)


def test_an_embedding_that_renormalises_its_rows_is_refused():
    """``max_norm`` writes the rows the private indices looked up into the weight, without clipping or noise."""
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 1))
    with pytest.raises(UnsupportedLayerError, match="max_norm"):
        engine_grads(model, lambda m, x: m(x).sum((1, 2)), torch.randint(0, 10, (4, 3)), 1.0)


def test_batch_normalisation_put_in_training_mode_after_planning_is_refused():
    """Planned in eval mode, then ``model.train()``, as a training loop does: batch statistics mix the samples."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 1)).eval()
    dp = DPEngine(model, max_grad_norm=1.0)
    step = dp.clipped_sum()
    step.add(lambda m, x: m(x).sum(-1), torch.randn(4, 3))
    step.privatize(expected_batch_size=4.0)
    model.train()
    with pytest.raises(UnsupportedLayerError, match="layer '1' .BatchNorm1d. mixes the samples"):
        dp.clipped_sum()


class InitialisesFromTheFirstBatch(nn.Module):
    """A data-dependent initialisation (ActNorm, LSUV): on its first training call it shifts its bias by the batch's
    mean output, and keeps the batch's scale in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("scale", torch.tensor(0.0))

    def forward(self, x):
        hidden = self.fc(x)
        if self.training and float(self.scale) == 0.0:
            with torch.no_grad():
                self.fc.bias.sub_(hidden.mean((0, 1)))
        return hidden.sum((1, 2))


class KeepsStatisticsLazily(nn.Module):
    """A statistic registered as None and filled in the training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.register_buffer("running_mean", None)

    def forward(self, x):
        hidden = self.fc(x)
        if self.training:
            self.running_mean = hidden.detach().mean((0, 1))
        return hidden.sum((1, 2))


@pytest.mark.parametrize(("model", "named"), [
    (InitialisesFromTheFirstBatch(), "parameter 'fc.bias' was written to while training on private data"),
    (KeepsStatisticsLazily(), "buffer 'running_mean' changed while training on private data"),
], ids=["data-dependent-init", "lazy-statistic"])
def test_private_data_written_into_a_weight_or_a_buffer_is_refused_in_any_forward(model, named):
    """Also in the layout check's own forwards, which run on the private microbatch before the training one."""
    x = torch.randn(4, 2, 3)
    with pytest.raises(UnsupportedLayerError, match=named):
        engine_grads(model, lambda m, b: m(b), x, 1.0)


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(3, 3), nn.Linear(3, 1)

    def forward(self, x):
        hidden = torch.utils.checkpoint.checkpoint(self.fc, x, use_reentrant=True)
        return self.head(hidden).sum((1, 2))


def test_reentrant_activation_checkpointing_is_refused_by_name():
    """Its layers run without autograd in the forward and again inside the backward, where their per-sample gradients
    cannot be kept (they were trained on noise alone)."""
    x = torch.randn(4, 2, 3, requires_grad=True)
    with pytest.raises(UnsupportedLayerError, match="layer 'fc' ran without autograd, or during the backward"):
        engine_grads(Checkpointed(), lambda m, b: m(b), x, 1.0)


def test_a_module_or_parameter_replaced_after_planning_is_planned_and_checked_again():
    """Fine-tuning code replacing a head (here with batch normalisation, refused) or a weight (trained privately)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    dp = DPEngine(model, max_grad_norm=1.0)

    def step():
        clipped = dp.clipped_sum()
        clipped.add(lambda m, x: m(x).sum(-1), torch.randn(4, 3))
        clipped.privatize(expected_batch_size=4.0)

    step()
    model[1].weight = nn.Parameter(torch.randn(2, 4))
    step()
    assert model[1].weight.grad is not None
    model[1] = nn.Sequential(nn.BatchNorm1d(4, affine=False), nn.Linear(4, 2))
    with pytest.raises(UnsupportedLayerError, match=r"layer '1.0' .BatchNorm1d. mixes the samples"):
        step()


def _move_first_bias_to_the_next_layer(model: nn.Sequential) -> None:
    """The same parameters in the same order over the whole model, held by other modules."""
    bias = model[0]._parameters.pop("bias")
    model[1]._parameters = {"moved": bias, **model[1]._parameters}


@pytest.mark.parametrize("change", [
    lambda m: m[0].weight.requires_grad_(False),
    lambda m: m[0].register_parameter("weight", nn.Parameter(m[0].weight.detach().clone())),
    lambda m: m[1].register_parameter("bias", None),
    _move_first_bias_to_the_next_layer,
    lambda m: setattr(m[1].weight, "data", m[1].weight.data.double()),
    lambda m: m[2].add_module("inner", nn.Linear(4, 4)),
    lambda m: m.append(nn.Identity()),
    lambda m: m._modules.update({"0": m[1], "1": m[0]}),
], ids=["frozen", "replaced", "removed", "moved-between-layers", "dtype", "child-of-a-leaf", "appended", "swapped"])
def test_the_write_guard_sees_each_change_to_the_modules_and_parameters(change):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.ReLU())
    guard = layout.WriteGuard(model)
    assert not guard.moved()
    change(model)
    assert guard.moved()


@pytest.mark.parametrize(("change", "named"), [
    (lambda m: m[2].register_buffer("mean", torch.zeros(4)), "buffer '2.mean' changed"),
    (lambda m: m[0].register_buffer("mean", torch.zeros(4)), "buffer '0.scale', '0.mean' changed"),
    (lambda m: m[0]._buffers.pop("scale"), r"buffer \(removed\) changed"),
    (lambda m: m[0].register_buffer("scale", torch.ones(4)), "buffer '0.scale' changed"),
    (lambda m: m[0].scale.add_(1), "buffer '0.scale' changed"),
], ids=["added-to-a-module-without", "added-beside-one", "removed", "replaced", "written"])
def test_the_write_guard_names_a_buffer_added_removed_replaced_or_written(change, named):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.ReLU())
    model[0].register_buffer("scale", torch.ones(4))
    guard = layout.WriteGuard(model)
    before = guard.snapshot()
    guard.check(before)
    change(model)
    with pytest.raises(UnsupportedLayerError, match=named):
        guard.check(before)


class FrozenStatistics(nn.Module):
    """Running statistics kept in frozen parameters, updated in place without autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.mean = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x):
        hidden = self.fc(x)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * hidden.mean((0, 1)))
        return hidden.sum((1, 2))


class CreatesAChildFromTheData(nn.Module):
    """Registers a child module in its first forward, holding the batch's statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        hidden = self.fc(x)
        if not hasattr(self, "stats"):
            self.stats = nn.Module()
            self.stats.register_buffer("mean", hidden.detach().mean((0, 1)))
        return hidden.sum((1, 2))


@pytest.mark.parametrize(("model", "named"), [
    (FrozenStatistics(), "parameter 'mean' was written to"),
    (CreatesAChildFromTheData(), "a module or parameter was added to, replaced in"),
], ids=["frozen-parameter", "child-module"])
def test_private_data_kept_in_a_frozen_parameter_or_a_new_module_is_refused(model, named):
    with pytest.raises(UnsupportedLayerError, match=named):
        engine_grads(model, lambda m, b: m(b), torch.randn(4, 2, 3), 1.0)


def standardised_pixels_loss(model, inputs):
    """Pixels as uint8, made floating point and standardised over the batch: a mistake the input check must see."""
    pixels = inputs.float() / 255
    pixels = (pixels - pixels.mean(0)) / (pixels.std(0) + 1e-6)
    return model(pixels).sum((1, 2))


def test_samples_mixed_after_an_integer_input_is_made_floating_point_are_refused():
    """uint8 pixels (as pre-training hands them over) and indices into a data set (as DP fine-tuning does) carry no
    gradient: the check watches the floating-point tensor the model makes of them."""
    pixels = torch.randint(0, 256, (4, 2, 3), dtype=torch.uint8)
    with pytest.raises(UnsupportedLayerError, match=r"rows of input \(made floating point by float\)"):
        engine_grads(nn.Linear(3, 1), standardised_pixels_loss, pixels, 1.0)
    images = torch.randn(10, 2, 3)

    def gathered(model, indices):
        chosen = images[indices]  # [B, 2, 3]
        return model(chosen - chosen.mean(0)).sum((1, 2))

    with pytest.raises(UnsupportedLayerError, match=r"rows of input \(made floating point by __getitem__\)"):
        engine_grads(nn.Linear(3, 1), gathered, torch.tensor([1, 4, 7, 2]), 1.0)
    engine_grads(nn.Linear(3, 1), lambda m, i: m(images[i]).sum((1, 2)), torch.tensor([1, 4, 7, 2]), 1.0)


def _filled(pixels):
    buffer = torch.empty(pixels.shape)
    buffer[:] = pixels
    return buffer


@pytest.mark.parametrize("to_float", [
    lambda p: p.permute(0, 3, 1, 2).float(),  # HWC pixels made CHW, the usual idiom
    lambda p: p.movedim(-1, 1).float(),
    lambda p: p.transpose(1, 3).float(),
    lambda p: torch.permute(input=p, dims=(0, 3, 1, 2)).float(),
    lambda p: p[torch.arange(p.shape[0])[:, None, None], torch.arange(4)[:, None], torch.arange(4)].float(),  # crop
    lambda p: p[: p.shape[0]].float(),
    lambda p: torch.cat([p, torch.zeros(p.shape[0], 4, 4, 1)], -1)[..., :3],  # coordinate channels, float by cat
    _filled,  # a float buffer filled from the pixels
], ids=["permute", "movedim", "transpose", "permute-keyword", "crop", "slice", "cat-constant", "setitem"])
def test_pixels_reordered_or_copied_before_a_batch_statistic_are_refused(to_float):
    """A reordering that keeps the batch on dim 0 is followed, and a float buffer the pixels are copied into is
    watched."""
    pixels = torch.randint(0, 256, (6, 4, 4, 3), dtype=torch.uint8)

    def loss(model, inputs):
        x = to_float(inputs)
        return model((x - x.mean(0)).flatten(1)).sum(-1)

    with pytest.raises(UnsupportedLayerError, match=r"rows of input \(made floating point by"):
        engine_grads(nn.Linear(48, 2), loss, pixels, 1.0)


def _per_image_loop(pixels):
    return torch.stack([pixels[i].flip(-1).float() / 255 for i in range(pixels.shape[0])])  # [B, 3, H, W]


def _channels_swapped(pixels):
    return torch.stack([pixels[:, 2], pixels[:, 1], pixels[:, 0]]).float().permute(1, 0, 2, 3) / 255  # [B, 3, H, W]


def _channels_stacked_by_keyword(pixels):
    return torch.stack(tensors=[pixels[:, 2], pixels[:, 1], pixels[:, 0]]).float().permute(1, 0, 2, 3) / 255


def _halves_in_a_named_tuple(pixels):
    halves = collections.namedtuple("Halves", "top bottom")(pixels[:, :2], pixels[:, 2:])
    return torch.cat(halves, 1).float() / 255


@pytest.mark.parametrize("to_float", [_per_image_loop, _channels_swapped, _channels_stacked_by_keyword,
                                      _halves_in_a_named_tuple],
                         ids=["per-image-loop", "channels-swapped", "stack-keyword", "named-tuple"])
@pytest.mark.parametrize("batch", [2, 3, 4])
def test_an_honest_model_is_accepted_whatever_the_batch_size(batch, to_float):
    """``pixels[i]`` of CHW images is ``[3, H, W]``, and a stack of their channels ``[3, B, H, W]``: with 3 samples
    either looks like the batch; followed as one it would seem mixed, and the step would fail exactly when 3 images
    are sampled."""
    pixels = torch.randint(0, 256, (batch, 3, 4, 4), dtype=torch.uint8)

    def loss(model, inputs):
        return model(to_float(inputs).flatten(1)).sum(-1)

    engine_grads(nn.Linear(48, 2), loss, pixels, 1.0)


def test_an_integer_input_beside_a_mixed_floating_point_one_does_not_hide_the_mixing():
    """Integer labels into the loss, or a boolean mask, beside pixels standardised over the batch: the watched
    conversion must keep the graph to the floating-point input (the fourth review: it cut it, 2.23-6.72 C)."""
    x, labels = torch.randn(4, 3), torch.randint(0, 2, (4,))
    model = nn.Linear(3, 2)

    def loss(m, inputs):
        pixels, targets = inputs
        return F.cross_entropy(m(pixels - pixels.mean(0)), targets, reduction="none")

    with pytest.raises(UnsupportedLayerError, match=r"rows of input\[0\]: the model or loss_fn mixes samples"):
        engine_grads(model, loss, (x, labels), 1.0)


def test_an_honest_model_indexing_a_table_with_positions_is_not_refused():
    """Integer tensors made inside the model (positions from arange) are not the inputs: a freed input-derived
    tensor's id reused by one of them falsely refused honest models (the fourth review, 14 of 40)."""
    table = torch.randn(8, 6)

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.out = nn.Embedding(5, 6), nn.Linear(6, 1)

        def forward(self, tokens):  # tokens: [B, 8]
            positions = table[torch.arange(tokens.shape[1])]  # [8, 6]
            return self.out(self.embed(tokens.long() % 5) + positions).sum((1, 2))

    for seed in range(10):
        torch.manual_seed(seed)
        engine_grads(Tokens(), lambda m, t: m(t), torch.randint(0, 100, (8, 8)), 1.0)


def test_integer_inputs_the_check_cannot_follow_are_named_in_a_warning(caplog):
    images = torch.randn(10, 3)
    with caplog.at_level("WARNING", logger="vip_core.privacy.layout"):
        engine_grads(nn.Linear(3, 1), lambda m, idx: m(torch.stack([images[int(i)] for i in idx])).sum(-1),
                     torch.tensor([1, 4, 7]), 1.0)
    assert "could not watch the integer inputs input" in caplog.text


def test_a_frozen_parameters_stale_gradient_is_dropped():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    model[0].weight.grad = torch.ones_like(model[0].weight)  # left by a non-private backward
    privatized_gradients(model, lambda m, x: m(x).sum(-1), torch.randn(2, 3), max_grad_norm=1.0,
                         noise_multiplier=0.0, expected_batch_size=2)
    assert model[0].weight.grad is None


class ModifiesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        hidden = x * 1.0
        out = self.fc(hidden)
        hidden.add_(1.0)  # after the layer ran: its kept input is no longer what it multiplied
        return (out + hidden).sum(-1)


def test_a_layer_input_modified_in_place_after_the_layer_ran_is_refused_by_name():
    with pytest.raises(RuntimeError, match="input of layer 'fc' was modified in place"):
        engine_grads(ModifiesItsInput(), lambda m, x: m(x), torch.randn(2, 4), 1.0)


def test_noise_without_a_stream_is_refused():
    with pytest.raises(ValueError, match="noise stream"):
        privatized_gradients(nn.Linear(2, 1), lambda m, x: m(x).sum(-1), torch.randn(2, 2), max_grad_norm=1.0,
                             noise_multiplier=1.0, expected_batch_size=2)


class RowBroadcastToken(nn.Module):
    """A ``[1, D]`` parameter added to ``[B, T, D]``: it broadcasts along the tokens, not the batch."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.offset = nn.Parameter(torch.randn(1, dim))

    def forward(self, x):  # x: [B, T, D]
        return (self.proj(x) + self.offset).square().mean((1, 2))  # [B]


def test_a_plain_parameter_broadcast_along_tokens_is_refused_when_the_microbatch_equals_the_tokens():
    # Batch 3 = 3 tokens: the [B, D] stand-in fits [T, D] and would silently give sample t's row to token t.
    with pytest.raises(UnsupportedLayerError, match=r"'offset' \[1, 4\].*mix samples"):
        privatized_gradients(RowBroadcastToken(), lambda m, x: m(x), torch.randn(3, 3, 4), max_grad_norm=1.0,
                             noise_multiplier=0.0, expected_batch_size=3)


def test_a_plain_parameter_broadcast_along_tokens_is_refused_by_name_when_the_shapes_clash():
    with pytest.raises(UnsupportedLayerError, match=r"offset.*broadcast against the batch dimension only"):
        privatized_gradients(RowBroadcastToken(), lambda m, x: m(x), torch.randn(2, 5, 4), max_grad_norm=1.0,
                             noise_multiplier=0.0, expected_batch_size=2)


class SequenceFirst(nn.Module):
    """A Linear run on ``[T, B, D]``: its input's dim 0 is the token, not the sample."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):  # x: [B, T, D]
        return self.fc(x.transpose(0, 1)).transpose(0, 1).square().mean((1, 2))  # [B]


class FlattenedTokens(SequenceFirst):
    def forward(self, x):  # x: [B, T, D], the Linear sees [B*T, D]
        return self.fc(x.reshape(-1, 4)).reshape(x.shape).square().mean((1, 2))  # [B]


def test_a_layer_run_sequence_first_is_refused_even_when_the_shapes_fit():
    # B = T = 4: every shape fits, and the rules would take token t for sample t.
    with pytest.raises(UnsupportedLayerError, match="layer 'fc'.*batch on dim 0"):
        engine_grads(SequenceFirst(), lambda m, x: m(x), torch.randn(4, 4, 4), 1.0)


def test_a_layer_run_on_flattened_tokens_is_refused_in_microbatches_of_one():
    with pytest.raises(UnsupportedLayerError, match="layer 'fc' ran on an input of 3 rows .* microbatch of 1"):
        engine_grads(FlattenedTokens(), lambda m, x: m(x), torch.randn(2, 3, 4), 1.0, physical=1)


class CentresOnTheBatch(nn.Module):
    """Subtracts the batch mean from its input before the first layer: every sample's loss depends on every other
    sample's data, which the layers' rows alone do not show."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):  # x: [B, T, 4]
        return self.fc(x - x.mean(0)).square().mean((1, 2))  # [B]


@pytest.mark.parametrize(("inputs", "loss_fn", "named"), [
    (torch.randn(4, 3, 4), lambda m, x: m(x), "input"),
    ((torch.arange(4), torch.randn(4, 3, 4)), lambda m, xs: m(xs[1]), "input[1]"),
    ({"x": torch.randn(4, 3, 4)}, lambda m, xs: m(xs["x"]), "input['x']"),
], ids=["tensor", "tuple", "dict"])
def test_samples_mixed_before_the_first_layer_are_refused_naming_the_input(inputs, loss_fn, named):
    """Removing one sample would move every other sample's clipped gradient: per-sample clipping bounds nothing."""
    with pytest.raises(UnsupportedLayerError, match=re.escape(f"rows of {named}: the model or loss_fn mixes samples")):
        privatized_gradients(CentresOnTheBatch(), loss_fn, inputs, max_grad_norm=1.0, noise_multiplier=0.0,
                             expected_batch_size=4)


def test_a_layer_unused_in_the_first_microbatch_is_checked_when_it_is_used():
    """The layout check goes on until every layer was reached: an auxiliary head used only by later samples."""

    class LateHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.late = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):  # x: [B, 4]; the head runs sequence-first when the batch's first value is negative
            if float(x[0, 0].detach()) < 0:
                return self.late(self.body(x).t().contiguous()).t().sum(-1)  # mixes samples
            return self.body(x).sum(-1)

    model = LateHead()
    x = torch.randn(4, 4)
    x[:, 0] = x[:, 0].abs()
    dp = DPEngine(model, max_grad_norm=1.0)
    clipped = dp.clipped_sum()
    clipped.add(lambda m, b: m(b), x)
    with pytest.raises(UnsupportedLayerError, match="sample 0's loss reaches other rows of the layer's output"):
        dp.clipped_sum().add(lambda m, b: m(b), torch.cat([-x[:, :1], x[:, 1:]], 1))


def test_a_loss_that_is_not_per_sample_is_refused():
    with pytest.raises(ValueError, match="one loss per sample"):
        privatized_gradients(
            nn.Linear(3, 1), lambda m, x: m(x).mean(), torch.randn(4, 3), max_grad_norm=1.0, noise_multiplier=1.0,
            expected_batch_size=4, noise=RandomStream(1, 0, "noise"),
        )


@pytest.mark.parametrize(("field", "value"), [("max_grad_norm", math.inf), ("max_grad_norm", math.nan),
                                              ("noise_multiplier", math.inf)])
def test_an_infinite_clipping_norm_or_noise_multiplier_is_refused(field, value):
    # An infinite C clips nothing: the sum's sensitivity would be unbounded.
    arguments = {"max_grad_norm": 1.0, "noise_multiplier": 1.0, field: value}
    with pytest.raises(ValueError, match=f"{field} must be finite"):
        privatized_gradients(nn.Linear(2, 2), lambda m, x: m(x).sum(-1), torch.randn(2, 2), expected_batch_size=1.0,
                             noise=RandomStream(1, 0, "noise"), **arguments)


@pytest.mark.parametrize(("shape", "kernel"), [((2, 3, 8, 8), (4, 4)), ((1, 2, 9, 7), (3, 2)), ((2, 1, 4, 4), (1, 1))])
def test_a_patch_embeddings_tokens_are_exactly_its_unfolded_input(shape, kernel):
    inputs = torch.randn(shape)
    unfolded = F.unfold(inputs, kernel, stride=kernel).transpose(1, 2)  # [B, T, C*kh*kw]
    assert torch.equal(per_sample.patches(inputs, kernel), unfolded)
    assert per_sample._cuts_patches(nn.Conv2d(shape[1], 4, kernel, stride=kernel))
    assert not per_sample._cuts_patches(nn.Conv2d(shape[1], 4, kernel, stride=(kernel[0] + 1, kernel[1])))
    assert not per_sample._cuts_patches(nn.Conv2d(shape[1], 4, kernel, stride=kernel, padding=1))


# ------------------------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_tensor_cores_pass_the_probe_and_removing_a_sample_moves_the_sum_by_at_most_c():
    device = torch.device("cuda")
    assert numerics.numerics_for(device, strict=False) is numerics.TENSOR_CORES
    torch.manual_seed(0)
    model = ConvNet().to(device)
    images, labels = torch.randn(6, 3, 16, 16, device=device), torch.randint(0, 5, (6,), device=device)
    images[2] *= 1000.0

    def loss(m, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(x).float()

    for removed in (0, 2, 5):
        assert leave_one_out(model, loss, (images, labels), 0.01, removed) <= 0.01 * (1 + 1e-5)


def _standardised_by_hand(model, pixels):
    x = pixels.float() / 255
    mean = x.mean(0)
    return model(((x - mean) / (((x - mean) ** 2).mean(0).sqrt() + 1e-6)).flatten(1)).sum(-1)


def _scaled_by_the_batch_max(model, pixels):
    x = pixels.float()
    return ((model((x / x.amax().clamp_min(1.0)).flatten(1)) - 1) ** 2).sum(-1)


@pytest.mark.parametrize("loss_fn, first", [
    (_standardised_by_hand, lambda p: p[:1].expand_as(p).clone()),  # identical images: sqrt(0)' gives NaN, not 0
    (_scaled_by_the_batch_max, lambda p: torch.cat([p[:1] * 0, p[1:-1], p[:1] * 0])),  # blank first and last images
], ids=["identical-images", "blank-ends"])
def test_crafted_images_in_the_checked_microbatch_do_not_hide_a_batch_statistic(loss_fn, first):
    pixels = torch.randint(1, 256, (8, 2, 2, 3), dtype=torch.uint8)  # 8: the mean of equal values is exact
    with pytest.raises(UnsupportedLayerError, match=r"rows of input \(made floating point by float\)"):
        engine_grads(nn.Linear(12, 1), loss_fn, first(pixels), 1.0)


@pytest.mark.parametrize("batch", [4, 100])
def test_pixels_viewed_as_int8_are_followed_at_any_batch_size(batch):
    pixels = torch.randint(0, 256, (batch, 2, 2, 3), dtype=torch.uint8)

    def loss(model, inputs):
        x = inputs.view(torch.int8).float()
        return model((x - x.mean(0)).flatten(1)).sum(-1)

    with pytest.raises(UnsupportedLayerError, match=r"rows of input \(made floating point by float\)"):
        engine_grads(nn.Linear(12, 1), loss, pixels, 1.0)


@pytest.mark.parametrize("batch", [2, 3, 4])
def test_channels_first_by_einsum_is_not_refused_when_the_batch_equals_the_channels(batch):
    pixels = torch.randint(0, 256, (batch, 2, 2, 3), dtype=torch.uint8)
    engine_grads(nn.Linear(12, 1), lambda m, p: m(torch.einsum("bhwc->cbhw", p).float().permute(1, 0, 2, 3)
                                                   .flatten(1)).sum(-1), pixels, 1.0)


@pytest.mark.parametrize("to_float, width", [
    (lambda p: torch.cat([p, torch.stack([p[(i + 1) % p.shape[0]] for i in range(p.shape[0])])], -1).float(), 24),
    (lambda p: p.clone().index_put_((torch.arange(p.shape[0]),), p.flip(0)).float(), 12),
    (lambda p: (p - p.min(0).values).float(), 12),
], ids=["cat-neighbour", "flip-into-copy", "integer-min"])
def test_pixels_mixed_before_they_are_made_floating_point_are_named_in_a_warning(to_float, width, caplog):
    pixels = torch.randint(0, 256, (4, 2, 2, 3), dtype=torch.uint8)
    with caplog.at_level("WARNING", logger="vip_core.privacy.layout"):
        engine_grads(nn.Linear(width, 1), lambda m, p: m(to_float(p).flatten(1)).sum(-1), pixels, 1.0)
    assert "could not watch the integer inputs input" in caplog.text


def _one_sum(engine, loss_fn, inputs):
    total = engine.clipped_sum()
    total.add(loss_fn, inputs)


def test_a_batch_statistic_behind_a_clamp_is_refused_even_on_black_and_white_images_where_the_clamp_is_flat():
    """Images pushed past the clamp hide the batch mean at their own point and nearby; the spread point sees it."""
    def loss_fn(model, p):
        x = ((p.float() / 255 - 0.5) * 1.5 + 0.5).clamp(0, 1)  # contrast boost
        x = x - x.mean(0)  # the mistake
        return model(x.flatten(1)).pow(2).sum(-1)

    bw = torch.zeros(4, 2, 2, 3, dtype=torch.uint8)
    bw[..., 1:, :] = 255
    with pytest.raises(UnsupportedLayerError, match="other samples' rows of input"):
        _one_sum(DPEngine(nn.Linear(12, 3), max_grad_norm=1.0), loss_fn, bw)


def test_a_batch_maximum_of_integer_pixels_beside_a_clean_conversion_is_named_in_the_warning(caplog):
    """``p.float() / p.amax()``: the maximum mixes the rows before they are floating point, so it cannot be watched."""
    def loss_fn(model, p):
        x = p.float() / p.amax().clamp_min(1)  # forgot the dims
        return model(x.flatten(1)).pow(2).sum(-1)

    p = torch.randint(0, 256, (4, 2, 2, 3), dtype=torch.uint8)
    with caplog.at_level(logging.WARNING):
        _one_sum(DPEngine(nn.Linear(12, 3), max_grad_norm=1.0), loss_fn, p)
    assert "could not watch the integer inputs input" in caplog.text


def test_code_valid_only_within_the_datas_range_is_checked_and_not_stopped_by_the_other_points(caplog):
    """A distribution's support and an assert on the range hold at every point the check visits."""
    def loss_fn(model, p):
        x = p.float().flatten(1) / 255
        assert float(x.detach().max()) <= 1.0
        return -ContinuousBernoulli(logits=model(x)).log_prob(x).sum(-1)

    p = torch.randint(0, 256, (4, 2, 2, 3), dtype=torch.uint8)
    p[:, 0, 0, 0] = 255
    engine = DPEngine(nn.Linear(12, 12), max_grad_norm=1.0)
    _one_sum(engine, loss_fn, p)
    assert engine.layout.done


def _bright(p):
    x = (p / 255 * 1.3).clamp(0, 1)  # a brightness boost (p / 255: not a plain conversion)
    x = x - x.mean(0)  # the mistake
    return x.flatten(1)


@pytest.mark.parametrize("floats", [False, True], ids=["uint8-divided", "float"])
def test_a_batch_statistic_behind_a_clamp_is_refused_on_bright_images_whose_range_the_clamp_flattens(floats):
    """The spread point covers [0, 1] whatever the data's range: bright images cannot keep the clamp flat there."""
    p = torch.randint(200, 256, (4, 2, 2, 3), dtype=torch.uint8)
    inputs = p.float() / 255 if floats else p

    def loss_fn(model, q):
        x = (q * 1.3).clamp(0, 1) - (q * 1.3).clamp(0, 1).mean(0) if floats else _bright(q).view(4, 2, 2, 3)
        return model(x.flatten(1)).pow(2).sum(-1)

    with pytest.raises(UnsupportedLayerError, match="other samples' rows of input"):
        _one_sum(DPEngine(nn.Linear(12, 3), max_grad_norm=1.0), loss_fn, inputs)


def test_unlabelled_first_and_last_samples_do_not_complete_the_input_check():
    """Samples whose loss does not reach their own inputs prove nothing; the next microbatch is checked."""
    def loss_fn(model, inputs):
        p, y = inputs
        x = p.float() / 255
        return F.cross_entropy(model((x - x.mean(0)).flatten(1)), y, ignore_index=-1, reduction="none")

    p = torch.randint(0, 256, (4, 2, 2, 3), dtype=torch.uint8)
    engine = DPEngine(nn.Linear(12, 3), max_grad_norm=1.0)
    _one_sum(engine, loss_fn, (p, torch.tensor([-1, 1, 2, -1])))
    assert not engine.layout.inputs_checked
    with pytest.raises(UnsupportedLayerError, match="other samples' rows of input"):
        _one_sum(engine, loss_fn, (p, torch.tensor([0, 1, 2, 0])))


@pytest.mark.parametrize("to_float", [
    lambda p: (lambda lo, hi: (p.float() - lo.view(-1, 1, 1, 1)) / (hi - lo).clamp(min=1).view(-1, 1, 1, 1))(
        *p.flatten(1).aminmax(dim=1)),
    lambda p: p.float() / p.flatten(1).max(dim=1).values.clamp(min=1).view(-1, 1, 1, 1),
    lambda p: torch.stack([c.float() for c in p.unbind(1)], 1),
], ids=["aminmax", "max-values", "unbind-channels"])
def test_per_image_integer_statistics_and_channel_splits_give_no_warning(to_float, caplog):
    """Statistics along a dim other than the batch's keep one sample per row: they are followed, not warned about."""
    p = torch.randint(0, 256, (4, 2, 2, 3), dtype=torch.uint8)
    with caplog.at_level(logging.WARNING):
        _one_sum(DPEngine(nn.Linear(12, 3), max_grad_norm=1.0),
                 lambda m, q: m(to_float(q).flatten(1)).pow(2).sum(-1), p)
    assert "could not watch" not in caplog.text


@pytest.mark.parametrize("batch", [2, 3, 4])
def test_an_integer_minimum_over_the_batch_through_a_tuple_is_still_named(batch, caplog):
    """A minimum over the batch mixes the rows, whatever the batch size: it is named in the warning."""
    p = torch.randint(0, 256, (batch, 2, 2, 3), dtype=torch.uint8)
    with caplog.at_level(logging.WARNING):
        _one_sum(DPEngine(nn.Linear(12, 3), max_grad_norm=1.0),
                 lambda m, q: m((q - q.min(0).values).float().flatten(1)).pow(2).sum(-1), p)
    assert "could not watch the integer inputs input" in caplog.text


def test_a_forward_hook_of_the_users_that_changes_a_layer_output_is_differentiated_through():
    # the weight's gradient is x^T times the gradient of the layer's own output, before the hook scales it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    model[0].register_forward_hook(lambda module, args, output: output * 3.0)
    assert_matches_reference(model, lambda m, x: m(x).square().sum(-1), torch.randn(5, 4), 0.5)


class ScalesItsTokens(nn.Module):
    """A Linear on [B, T, d] (its output a view of a [B·T, d] result) whose output is then changed in place."""

    def __init__(self, inplace: str) -> None:
        super().__init__()
        self.fc, self.out, self.inplace = nn.Linear(4, 6), nn.Linear(6, 2), inplace

    def forward(self, x):
        hidden = self.fc(x)
        if self.inplace == "relu":
            hidden.relu_()
        else:
            hidden[:, 0].mul_(2.0)
        return self.out(hidden)


@pytest.mark.parametrize("inplace", ["relu", "slice"])
def test_a_token_layers_output_changed_in_place_afterwards_gives_the_exact_clipped_sum(inplace):
    torch.manual_seed(0)
    assert_matches_reference(ScalesItsTokens(inplace), lambda m, x: m(x).square().sum((1, 2)), torch.randn(5, 3, 4),
                             0.5)


class CentresALayerOutput(nn.Module):
    """Batch centring of a layer's output, where the input check cannot see it (the input is prepared without
    autograd): in a user's forward hook, in place, or after a ``.forward`` called directly."""

    def __init__(self, route: str) -> None:
        super().__init__()
        self.a, self.b, self.route = nn.Linear(8, 16), nn.Linear(16, 4), route
        if route == "hook":
            self.a.register_forward_hook(lambda module, args, output: output - output.mean(0, keepdim=True))

    def forward(self, x):
        with torch.no_grad():
            x = x * 0.5
        if self.route == "direct":
            hidden = self.a.forward(x)
            hidden = hidden - hidden.mean(0, keepdim=True)
        else:
            hidden = self.a(x)
            if self.route == "in place":
                hidden -= hidden.mean(0, keepdim=True)
        return self.b(torch.tanh(hidden)).square().sum(1)


@pytest.mark.parametrize("route", ["hook", "in place", "direct"])
def test_samples_mixed_right_after_a_layer_are_refused_however_the_model_does_it(route):
    with pytest.raises(UnsupportedLayerError, match="layer 'a': sample 0's loss reaches other rows"):
        engine_grads(CentresALayerOutput(route), lambda m, x: m(x), torch.randn(8, 8), 1.0)


class CallsForwardDirectly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.b.forward(torch.tanh(self.a.forward(x)))


def test_layers_whose_forward_is_called_directly_give_the_exact_clipped_sum():
    torch.manual_seed(0)
    assert_matches_reference(CallsForwardDirectly(), lambda m, x: m(x).square().sum(-1), torch.randn(5, 4), 0.5)


class ScalesAGradient(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.mid, self.b = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        hidden = self.mid(torch.tanh(self.a(x)))
        hidden.register_hook(lambda grad: grad * 5.0)
        return self.b(torch.tanh(hidden))


@pytest.mark.parametrize("helpers", [False, True], ids=["alone", "with-helpers"])
def test_a_tensor_hook_of_the_users_on_a_layer_output_is_in_the_gradient_clipped(monkeypatch, helpers):
    """The weight gradient autograd would compute sees the hook's scaling, so the clipped one must too."""
    if helpers:
        hand_every_task_to_helpers(monkeypatch)
    torch.manual_seed(0)
    assert_matches_reference(ScalesAGradient(), lambda m, x: m(x).square().sum(-1), torch.randn(5, 4), 10.0)


class ScaleGradientInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, through_data):
        ctx.through_data = through_data
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.05)  # the helper has the layer by now
        (grad.data if ctx.through_data else grad).mul_(10.0)  # .data: a write no version counter sees
        return grad, None


class SharesAGradient(nn.Module):
    """A custom Function whose backward scales, in place, the gradient it shares with layer ``fc``'s output, after
    ``fc``'s own backward node has run (as plain autograd runs them)."""

    def __init__(self, through_data: bool) -> None:
        super().__init__()
        self.inp, self.fc, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 2)
        self.through_data = through_data

    def forward(self, x):
        hidden = torch.tanh(self.inp(x))
        scaled = ScaleGradientInPlace.apply(torch.sin(hidden), self.through_data)  # its node runs after fc's
        return self.head(torch.tanh(scaled + self.fc(hidden)))


@pytest.mark.parametrize("through_data", [False, True], ids=["in-place", "through-data"])
@pytest.mark.parametrize("shape", [(6, 8), (6, 3, 8)], ids=["rows", "tokens"])
def test_a_gradient_written_into_after_its_layer_was_handed_to_a_helper_leaves_the_clipped_sum_exact(
        monkeypatch, through_data, shape):
    """The helper computes a layer's norm and its sum from copies taken when the layer is handed over: a later write
    into the gradient cannot make them disagree (the norm of one value, the sum of another)."""
    hand_every_task_to_helpers(monkeypatch)
    torch.manual_seed(0)
    inputs = torch.randn(*shape)
    inputs[2] *= 100.0
    assert_matches_reference(SharesAGradient(through_data), lambda m, x: m(x).square().flatten(1).sum(1), inputs,
                             0.01)


class KeepsItsLastOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        self.last = self.a(x)  # kept for logging, with its graph
        return self.b(torch.tanh(self.last)).sum(-1)


@pytest.mark.parametrize("helpers", [False, True], ids=["alone", "with-helpers"])
def test_a_model_that_keeps_an_output_with_its_graph_is_freed_once_dropped(monkeypatch, helpers):
    """The graph the model keeps must not hold the engine's listeners, which hold the engine and the model."""
    if helpers:
        hand_every_task_to_helpers(monkeypatch)
    model = KeepsItsLastOutput()
    engine_grads(model, lambda m, x: m(x), torch.randn(3, 4), 1.0)
    kept = weakref.ref(model)
    del model
    gc.collect()
    assert kept() is None


def test_the_groups_work_is_shared_evenly_between_the_steps_thread_and_its_helper(monkeypatch):
    """A ViT's groups each give a small bias sum and a large weight sum: the helper must take about half of the
    work, not every weight sum (which left the step's own thread idle while the helper did the clipped sums)."""
    shared = []

    def spied(weights, helpers):
        shares = split(weights, helpers)
        shared.append((weights, shares))
        return shares

    split = engine._shares
    monkeypatch.setattr(engine, "_shares", spied)
    monkeypatch.setattr(engine, "idle_cores", lambda: torch.get_num_threads())
    monkeypatch.setattr(engine, "SPREAD_MIN_WORK", 1 << 12)
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=4, num_classes=3)
    assert_matches_reference(vit, classification_loss, vit_inputs(5), max_grad_norm=0.05)
    assert len(shared) == 2  # the norms, then the clipped sums
    for weights, shares in shared:
        handed = {index for share in shares for index in share}
        heavy = [weight for weight in weights if weight >= engine.SPREAD_MIN_WORK]
        helper = sum(weights[index] for index in handed)
        own = sum(weights) - helper
        assert len(heavy) >= 4 and shares
        assert abs(own - helper) <= max(heavy)  # largest first, each to the thread with less work


def test_a_step_that_fails_on_its_own_thread_waits_for_its_helpers_before_it_raises(monkeypatch):
    """A clipped sum still running on a helper after the step failed (out of memory, a Ctrl-C) would add a sample of
    the batch given up into the buffer of the next step, whose noise is sized for its own batch only."""
    monkeypatch.setattr(engine, "idle_cores", lambda: torch.get_num_threads())
    finished = []

    def slow() -> None:
        time.sleep(0.3)
        finished.append(True)

    def fails() -> None:
        raise RuntimeError("out of memory")

    work = engine.SPREAD_MIN_WORK
    with pytest.raises(RuntimeError, match="out of memory"):
        engine._spread([(work, slow), (2 * work, fails)], torch.device("cpu"))  # the larger stays on this thread
    assert finished == [True]


def test_a_helpers_sum_left_running_by_an_interrupted_step_adds_nothing_to_the_next_sum(monkeypatch):
    """A Ctrl-C can come while the step waits for its helpers: a clipped sum still running on a helper must not add a
    sample of the batch given up into the next sum, whose noise is sized for its own batch."""
    monkeypatch.setattr(engine, "idle_cores", lambda: torch.get_num_threads())
    monkeypatch.setattr(engine, "SPREAD_MIN_WORK", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    fresh = nn.Sequential(*[layer for layer in model])  # the same parameters, another engine

    def loss_fn(m, x):
        return m(x).square().sum(-1) * 100.0  # every sample clipped

    first, second = torch.randn(6, 6), torch.randn(1, 6)
    each, waits = engine._each, []

    def late(tasks):
        time.sleep(0.3)
        return each(tasks)

    def interrupted(futures):
        waits.append(len(futures))
        if len(waits) == 2:  # the clipped sums' wait (the norms' is the first)
            raise KeyboardInterrupt

    dp = DPEngine(model, max_grad_norm=0.3)
    with monkeypatch.context() as patch:
        patch.setattr(engine, "_each", late)
        patch.setattr(engine, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            dp.clipped_sum().add(loss_fn, first)
    total = dp.clipped_sum()
    total.add(loss_fn, second)
    total.privatize(expected_batch_size=1.0)
    time.sleep(0.6)  # the helper's sum of the first batch is done by now
    got = [p.grad.clone() for p in model.parameters()]
    privatized_gradients(fresh, loss_fn, second, max_grad_norm=0.3, noise_multiplier=0.0, expected_batch_size=1.0)
    assert all(torch.equal(a, p.grad) for a, p in zip(got, fresh.parameters()))


def test_a_ctrl_c_while_the_forwards_are_being_wrapped_leaves_every_module_as_it_was():
    class SlowToWrap(nn.Linear):
        @property
        def forward(self):  # a Ctrl-C that lands after this module was recorded, before its forward is swapped
            raise KeyboardInterrupt

    wrapped, interrupted = nn.Linear(2, 2), SlowToWrap(2, 2)
    with pytest.raises(KeyboardInterrupt) as caught:
        with layout.wrapped_forwards([wrapped, interrupted], lambda module, forward, x: forward(x) * 0):
            pass
    assert caught.value.__context__ is None  # the Ctrl-C itself, not an error of the undoing
    assert "forward" not in wrapped.__dict__ and "forward" not in interrupted.__dict__
    assert wrapped(torch.ones(1, 2)).abs().sum() > 0  # its own forward again


def test_a_layer_left_wrapped_by_an_undo_a_ctrl_c_cut_short_is_refused_by_the_next_sum():
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    dp = DPEngine(model, max_grad_norm=1.0)
    left = layout.wrapped_forwards([model[2]], lambda module, forward, x: forward(x))
    left.__enter__()  # and never left: what an undo stopped before this module leaves
    with pytest.raises(RuntimeError, match="a Linear's forward is still wrapped by an earlier step .* start the "
                                           "process again"):
        dp.clipped_sum().add(lambda m, x: m(x).sum(-1), torch.randn(3, 4))
    assert "forward" not in model[0].__dict__  # the layers wrapped before the refusal are undone


def test_a_sum_whose_add_failed_refuses_to_go_on_even_where_a_second_ctrl_c_stopped_it_closing(monkeypatch):
    """A failed add leaves part of a batch in the sum: adding the batch again would count its samples twice."""
    dp = DPEngine(nn.Linear(4, 2), max_grad_norm=1.0)
    total = dp.clipped_sum()

    def fails(m, x):
        raise RuntimeError("out of memory")

    def cut_short(self, reason):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(engine.ClippedGradientSum, "close", cut_short)
        with pytest.raises(KeyboardInterrupt):
            total.add(fails, torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="failed part-way"):
        total.add(lambda m, x: m(x).sum(-1), torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="failed part-way"):
        total.privatize(expected_batch_size=3.0)
