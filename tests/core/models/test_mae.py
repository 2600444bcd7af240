"""The masked autoencoder: shapes, patches, masking, the per-sample loss, and the exported encoder."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call, grad, vmap

from vip_core.config import ModelConfig, get_preset
from vip_core.models import (
    build_encoder,
    build_mae,
    export_encoder,
    get_2d_sincos_pos_embed,
    patchify,
    unpatchify,
)

TINY = get_preset("tiny").model


@pytest.fixture(scope="module")
def mae():
    torch.manual_seed(0)
    return build_mae(TINY)


def images(n: int, config: ModelConfig = TINY, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, config.in_chans, config.img_size, config.img_size, generator=generator)


def identity_order_noise(n: int, num_patches: int) -> torch.Tensor:
    """Noise that ranks the patches in image order, so nothing is shuffled."""
    return torch.arange(num_patches, dtype=torch.float32).expand(n, num_patches)


CONFIGS = {
    "tiny": TINY,
    "grey-patch8": TINY.model_copy(update=dict(patch_size=8, in_chans=1, mask_ratio=0.5)),
    "nano-at-32px": get_preset("vip-nano").model.model_copy(update=dict(img_size=32)),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_shapes(name):
    config = CONFIGS[name]
    model = build_mae(config)
    n, num_patches = 3, (config.img_size // config.patch_size) ** 2
    loss, pred, mask = model(images(n, config))
    assert loss.shape == (n,)
    assert pred.shape == (n, num_patches, config.patch_size**2 * config.in_chans)
    assert mask.shape == (n, num_patches)
    assert torch.isfinite(loss).all()
    latent, _, _ = model.forward_encoder(images(n, config), config.mask_ratio)
    assert latent.shape == (n, 1 + int(num_patches * (1 - config.mask_ratio)), config.embed_dim)


def test_patchify_unpatchify_round_trip_and_layout():
    imgs = images(2)
    patches = patchify(imgs, 4)
    assert patches.shape == (2, 64, 48)
    assert torch.equal(unpatchify(patches, 4, 3), imgs)
    # patch 9 is row 1, column 1 of the 8x8 grid; its pixels are ordered (row, col, channel)
    assert torch.equal(patches[:, 9], imgs[:, :, 4:8, 4:8].permute(0, 2, 3, 1).reshape(2, 48))


def test_patchify_rejects_non_square_images():
    with pytest.raises(ValueError, match="square"):
        patchify(torch.zeros(1, 3, 32, 28), 4)


@pytest.mark.parametrize("ratio", [0.75, 0.5, 0.9, 0.3, 0.0])
def test_masking_keeps_int_l_times_one_minus_ratio(mae, ratio):
    x = torch.randn(5, mae.num_patches, 8)
    kept, mask, ids_restore = mae.random_masking(x, ratio, torch.rand(5, mae.num_patches))
    len_keep = int(mae.num_patches * (1 - ratio))
    assert kept.shape == (5, len_keep, 8)
    assert mask.sum(dim=1).tolist() == [mae.num_patches - len_keep] * 5
    # the kept tokens are exactly the unmasked patches
    for i in range(5):
        assert torch.equal(torch.sort(kept[i], dim=0).values, torch.sort(x[i][mask[i] == 0], dim=0).values)


# (L, mask ratio) where L·(1 − r) is not whole and rounding would keep one patch more than truncating.
FRACTIONAL_KEEPS = [(196, 0.7), (64, 0.3), (49, 0.6), (10, 0.25)]


@pytest.mark.parametrize(("num_patches", "ratio"), FRACTIONAL_KEEPS)
def test_masking_keeps_as_many_patches_as_the_official_mae(mae, num_patches, ratio):
    official_len_keep = int(num_patches * (1 - ratio))  # facebookresearch/mae models_mae.py random_masking
    assert round(num_patches * (1 - ratio)) == official_len_keep + 1
    noise = torch.rand(3, num_patches)
    kept, mask, _ = mae.random_masking(torch.randn(3, num_patches, 4), ratio, noise)
    assert kept.shape == (3, official_len_keep, 4)
    kept_ranks = noise.argsort(dim=1).argsort(dim=1) < official_len_keep  # [3, L]: the lowest noise is kept
    assert torch.equal(mask, (~kept_ranks).float())


def test_masking_keeps_the_lowest_noise(mae):
    noise = torch.rand(4, mae.num_patches)
    _, mask, _ = mae.random_masking(torch.zeros(4, mae.num_patches, 2), 0.75, noise)
    threshold = noise.sort(dim=1).values[:, 16:17]  # the 17th smallest: the first masked
    assert torch.equal(mask, (noise >= threshold).float())


def test_masks_are_reproducible_with_explicit_noise_and_seeded_generator(mae):
    imgs = images(4)
    noise = torch.rand(4, mae.num_patches)
    loss_a, _, mask_a = mae(imgs, noise=noise)
    loss_b, _, mask_b = mae(imgs, noise=noise.clone())
    assert torch.equal(mask_a, mask_b) and torch.equal(loss_a, loss_b)

    _, _, seeded_a = mae(imgs, generator=torch.Generator().manual_seed(7))
    _, _, seeded_b = mae(imgs, generator=torch.Generator().manual_seed(7))
    _, _, other = mae(imgs, generator=torch.Generator().manual_seed(8))
    assert torch.equal(seeded_a, seeded_b)
    assert not torch.equal(seeded_a, other)
    # each sample gets its own mask
    assert len({tuple(row.tolist()) for row in seeded_a}) == 4


def test_per_sample_loss_equals_each_sample_alone(mae):
    imgs, noise = images(4), torch.rand(4, mae.num_patches)
    batch_loss, batch_pred, _ = mae(imgs, noise=noise)
    for i in range(4):
        alone_loss, alone_pred, _ = mae(imgs[i : i + 1], noise=noise[i : i + 1])
        torch.testing.assert_close(batch_loss[i : i + 1], alone_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(batch_pred[i : i + 1], alone_pred, rtol=1e-5, atol=1e-5)


def test_a_sample_loss_ignores_the_other_samples(mae):
    imgs, noise = images(3), torch.rand(3, mae.num_patches)
    changed = imgs.clone()
    changed[1:] = torch.rand_like(changed[1:])
    torch.testing.assert_close(mae(imgs, noise=noise)[0][0], mae(changed, noise=noise)[0][0])


def test_loss_counts_only_masked_patches(mae):
    imgs = images(2)
    _, mask, _ = mae.forward_encoder(imgs, 0.75, torch.rand(2, mae.num_patches))
    pred = patchify(imgs, 4).clone()
    pred[mask == 0] += 100.0  # wrong everywhere the patch was visible
    assert mae.forward_loss(imgs, pred, mask).tolist() == [0.0, 0.0]
    pred[mask == 1] += 0.5  # off by 0.5 on every masked pixel
    torch.testing.assert_close(mae.forward_loss(imgs, pred, mask), torch.full((2,), 0.25))


def test_norm_pix_loss_targets_patch_normalised_pixels():
    model = build_mae(TINY.model_copy(update=dict(norm_pix_loss=True)))
    imgs = images(2)
    target = patchify(imgs, 4)
    normalised = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6).sqrt()
    mask = torch.ones(2, model.num_patches)
    assert model.forward_loss(imgs, normalised, mask).max() < 1e-6
    # invariant to a per-image gain and offset, unlike the plain pixel loss
    pred = torch.randn_like(target)
    torch.testing.assert_close(
        model.forward_loss(imgs, pred, mask), model.forward_loss(3 * imgs + 1, pred, mask), rtol=1e-4, atol=1e-6
    )
    plain = build_mae(TINY)
    assert not torch.allclose(plain.forward_loss(imgs, pred, mask), plain.forward_loss(3 * imgs + 1, pred, mask))


def test_tokens_train_and_position_embeddings_stay_fixed(mae):
    trainable = {name for name, p in mae.named_parameters() if p.requires_grad}
    assert {"cls_token", "mask_token"} <= trainable
    assert not {"pos_embed", "decoder_pos_embed"} & trainable
    mae.zero_grad()
    mae(images(2))[0].sum().backward()
    assert mae.cls_token.grad.abs().sum() > 0 and mae.mask_token.grad.abs().sum() > 0
    assert mae.pos_embed.grad is None
    mae.zero_grad()


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # no vmap rule for CPU fused attention
def test_per_sample_gradients_under_vmap_match_one_at_a_time(mae):
    """What a DP engine does: vmap a single-sample gradient over the batch, masking noise passed in."""
    imgs, noise = images(3), torch.rand(3, mae.num_patches)
    params = {k: p.detach() for k, p in mae.named_parameters() if p.requires_grad}
    frozen = {k: p.detach() for k, p in mae.named_parameters() if not p.requires_grad}

    def sample_loss(p, img, sample_noise):
        loss, _, _ = functional_call(mae, (p, frozen), (img[None],), {"noise": sample_noise[None]})
        return loss[0]

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, imgs, noise)
    for i in range(3):
        mae.zero_grad()
        mae(imgs[i : i + 1], noise=noise[i : i + 1])[0].sum().backward()
        for name, p in mae.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(per_sample[name][i], p.grad, rtol=1e-4, atol=1e-6)
    mae.zero_grad()


def test_bad_inputs_name_the_problem(mae):
    with pytest.raises(ValueError, match=r"images must have shape \[N, 3, 32, 32\]"):
        mae(torch.zeros(2, 3, 28, 28))
    with pytest.raises(ValueError, match="noise must have shape"):
        mae(images(2), noise=torch.rand(2, 10))
    with pytest.raises(ValueError, match="mask_ratio"):
        mae(images(2), mask_ratio=1.0)


def test_sincos_position_embedding_layout():
    dim, grid = 16, 3
    embed = get_2d_sincos_pos_embed(dim, grid, cls_token=True)
    assert embed.shape == (1 + grid * grid, dim)
    assert torch.equal(embed[0], torch.zeros(dim))
    row, col = 2, 1
    token = embed[1 + row * grid + col]
    omega = [1 / 10000 ** (k / 4) for k in range(4)]  # D/4 frequencies
    expected = (
        [math.sin(col * w) for w in omega] + [math.cos(col * w) for w in omega]
        + [math.sin(row * w) for w in omega] + [math.cos(row * w) for w in omega]
    )
    torch.testing.assert_close(token, torch.tensor(expected))


def test_model_position_embeddings_are_sincos(mae):
    torch.testing.assert_close(mae.pos_embed[0], get_2d_sincos_pos_embed(64, 8, cls_token=True))
    torch.testing.assert_close(mae.decoder_pos_embed[0], get_2d_sincos_pos_embed(32, 8, cls_token=True))


@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_exported_encoder_equals_mae_encoder(mae, global_pool):
    imgs = images(3)
    vit = export_encoder(mae, global_pool=global_pool)
    with torch.no_grad():
        latent, mask, _ = mae.forward_encoder(imgs, 0.0, identity_order_noise(3, mae.num_patches))
        features = vit.forward_features(imgs)
        pooled = vit(imgs)
    assert mask.sum() == 0
    torch.testing.assert_close(features, latent, rtol=1e-5, atol=1e-5)
    expected = latent[:, 0] if global_pool == "token" else latent[:, 1:].mean(dim=1)
    torch.testing.assert_close(pooled, expected, rtol=1e-5, atol=1e-5)


def test_exported_encoder_is_a_copy_with_a_head(mae):
    vit = export_encoder(mae, num_classes=10)
    assert vit(images(2)).shape == (2, 10)
    with torch.no_grad():
        vit.blocks[0].attn.qkv.weight.zero_()
    assert mae.blocks[0].attn.qkv.weight.abs().sum() > 0


def test_build_encoder_is_a_fresh_encoder_of_the_same_size(mae):
    torch.manual_seed(5)
    vit = build_encoder(TINY, num_classes=7)
    assert vit(images(2)).shape == (2, 7)
    exported = export_encoder(mae)
    assert {k: v.shape for k, v in vit.state_dict().items() if not k.startswith("head.")} == {
        k: v.shape for k, v in exported.state_dict().items()
    }
    torch.testing.assert_close(vit.pos_embed, mae.pos_embed)
    assert not torch.equal(vit.blocks[0].attn.qkv.weight, exported.blocks[0].attn.qkv.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_forward_with_a_cpu_generator_masks_as_on_cpu(mae):
    cuda_model = build_mae(TINY).cuda()
    cuda_model.load_state_dict(mae.state_dict())
    imgs = images(4)
    _, _, cpu_mask = mae(imgs, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _, cuda_mask = cuda_model(imgs.cuda(), generator=torch.Generator().manual_seed(3))
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    assert torch.equal(cuda_mask.float().cpu(), cpu_mask)
