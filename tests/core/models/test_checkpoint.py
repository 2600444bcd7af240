"""Checkpoints: released MAE/ViP .pth files load strictly; our own save and load round trip."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from torch import nn

from vip_core.config import get_preset
from vip_core.models import (
    CheckpointError,
    build_mae,
    export_encoder,
    load_checkpoint,
    load_encoder,
    load_mae,
    save_checkpoint,
)

TINY_RUN = get_preset("tiny")
TINY = TINY_RUN.model
# ViP-Nano (192 wide, 12 blocks, 12 heads, decoder 512 x 4 x 16 heads, patch 16) at 32 px: 4 patches
NANO_32 = get_preset("vip-nano").model.model_copy(update=dict(img_size=32))

BLOCK_KEYS = {
    "norm1.weight": lambda d: (d,),
    "norm1.bias": lambda d: (d,),
    "attn.qkv.weight": lambda d: (3 * d, d),
    "attn.qkv.bias": lambda d: (3 * d,),
    "attn.proj.weight": lambda d: (d, d),
    "attn.proj.bias": lambda d: (d,),
    "norm2.weight": lambda d: (d,),
    "norm2.bias": lambda d: (d,),
    "mlp.fc1.weight": lambda d: (4 * d, d),
    "mlp.fc1.bias": lambda d: (4 * d,),
    "mlp.fc2.weight": lambda d: (d, 4 * d),
    "mlp.fc2.bias": lambda d: (d,),
}


def released_encoder_shapes(dim=192, depth=12, tokens=5, patch=16) -> dict[str, tuple[int, ...]]:
    """The encoder keys and shapes of facebookresearch/mae and ViP-MAE checkpoints, written out by name."""
    shapes = {
        "cls_token": (1, 1, dim),
        "pos_embed": (1, tokens, dim),
        "patch_embed.proj.weight": (dim, 3, patch, patch),
        "patch_embed.proj.bias": (dim,),
        "norm.weight": (dim,),
        "norm.bias": (dim,),
    }
    for n in range(depth):
        shapes.update({f"blocks.{n}.{key}": shape(dim) for key, shape in BLOCK_KEYS.items()})
    return shapes


def released_mae_shapes(dim=192, depth=12, dec_dim=512, dec_depth=4, tokens=5, patch=16) -> dict[str, tuple[int, ...]]:
    """Encoder plus decoder keys of a released full MAE/ViP checkpoint."""
    shapes = released_encoder_shapes(dim, depth, tokens, patch)
    shapes.update({
        "mask_token": (1, 1, dec_dim),
        "decoder_pos_embed": (1, tokens, dec_dim),
        "decoder_embed.weight": (dec_dim, dim),
        "decoder_embed.bias": (dec_dim,),
        "decoder_norm.weight": (dec_dim,),
        "decoder_norm.bias": (dec_dim,),
        "decoder_pred.weight": (patch * patch * 3, dec_dim),
        "decoder_pred.bias": (patch * patch * 3,),
    })
    for n in range(dec_depth):
        shapes.update({f"decoder_blocks.{n}.{key}": shape(dec_dim) for key, shape in BLOCK_KEYS.items()})
    return shapes


def random_state(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}


@pytest.fixture(scope="module")
def released_nano(tmp_path_factory):
    """A file in the released format: ``{"model": state_dict}``, MAE's ``args`` and optimizer beside it."""
    state = random_state(released_mae_shapes())
    path = tmp_path_factory.mktemp("released") / "vip_nano.pth"
    torch.save({"model": state, "args": argparse.Namespace(model="mae_vit_nano_dec512d4b"), "epoch": 3}, path)
    return path, state


def test_released_full_checkpoint_loads_every_key(released_nano):
    path, state = released_nano
    mae = load_mae(path, model_config=NANO_32)
    loaded = mae.state_dict()
    assert loaded.keys() == state.keys()
    for key in state:
        assert torch.equal(loaded[key], state[key]), key


def test_fresh_model_has_the_released_keys_and_shapes():
    shapes = {key: tuple(value.shape) for key, value in build_mae(NANO_32).state_dict().items()}
    assert shapes == released_mae_shapes()


def test_released_checkpoint_without_config_needs_one(released_nano):
    with pytest.raises(CheckpointError, match="pass model_config"):
        load_mae(released_nano[0])


def test_mismatched_checkpoint_fails_naming_the_keys(tmp_path, released_nano):
    state = dict(released_nano[1])
    del state["mask_token"]
    state["decoder_blocks.9.norm1.weight"] = torch.zeros(512)
    state["pos_embed"] = torch.zeros(1, 197, 192)
    path = tmp_path / "bad.pth"
    torch.save({"model": state}, path)
    with pytest.raises(CheckpointError) as failure:
        load_mae(path, model_config=NANO_32)
    message = str(failure.value)
    assert str(path) in message
    assert "missing keys: mask_token" in message
    assert "unexpected keys: decoder_blocks.9.norm1.weight" in message
    assert "pos_embed (1, 197, 192) vs model (1, 5, 192)" in message


def test_released_checkpoint_of_another_size_fails(released_nano):
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load_mae(released_nano[0], model_config=NANO_32.model_copy(update=dict(img_size=64)))


def test_load_encoder_from_released_full_checkpoint(released_nano):
    path, state = released_nano
    vit = load_encoder(path, model_config=NANO_32)
    assert torch.equal(vit.blocks[11].mlp.fc2.weight, state["blocks.11.mlp.fc2.weight"])
    assert torch.equal(vit.norm.weight, state["norm.weight"])
    assert vit(torch.rand(2, 3, 32, 32)).shape == (2, 192)


def test_load_encoder_from_released_encoder_only_checkpoint(tmp_path):
    state = random_state(released_encoder_shapes(), seed=1)
    path = tmp_path / "mae_pretrain_vit_nano.pth"
    torch.save({"model": state}, path)
    vit = load_encoder(path, model_config=NANO_32, num_classes=10)
    assert torch.equal(vit.cls_token, state["cls_token"])
    assert torch.equal(vit.blocks[0].attn.qkv.bias, state["blocks.0.attn.qkv.bias"])
    assert vit(torch.rand(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(CheckpointError, match="missing keys: blocks.3.attn.proj.bias"):
        torch.save({"model": {k: v for k, v in state.items() if k != "blocks.3.attn.proj.bias"}}, path)
        load_encoder(path, model_config=NANO_32)


def test_save_and_load_round_trip(tmp_path):
    torch.manual_seed(3)
    mae = build_mae(TINY)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    written = save_checkpoint(run_dir, model=mae, config=TINY_RUN, stage="synthetic", step=12)
    assert written == run_dir / "checkpoint.pt"
    assert os.listdir(run_dir) == ["checkpoint.pt"]

    payload = load_checkpoint(run_dir)
    assert payload["stage"] == "synthetic" and payload["step"] == 12
    assert payload["config"] == TINY_RUN.model_dump(mode="json")

    restored = load_mae(run_dir)
    assert restored.config == TINY
    for key, value in mae.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key

    imgs = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(load_encoder(written)(imgs), export_encoder(mae)(imgs))


def test_save_overwrites_whole_and_unwraps_wrappers(tmp_path):
    class Wrapper(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    first, second = build_mae(TINY), build_mae(TINY)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=first, config=TINY_RUN)
    save_checkpoint(path, model=Wrapper(second), config=TINY_RUN)
    assert torch.equal(load_mae(path).cls_token, second.cls_token)
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_save_needs_a_vip_config(tmp_path):
    with pytest.raises(TypeError, match="VipConfig"):
        save_checkpoint(tmp_path / "c.pt", model=build_mae(TINY), config=TINY)


def test_unreadable_checkpoints_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "absent.pt")
    with pytest.raises(FileNotFoundError, match="checkpoint.pt"):
        load_checkpoint(tmp_path)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="garbage.pt: not a readable checkpoint"):
        load_checkpoint(garbage)
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"model": {}, "hook": nn.Identity()}, unsafe)
    with pytest.raises(CheckpointError, match="unsafe.pt: not a readable checkpoint"):
        load_checkpoint(unsafe)
    no_model = tmp_path / "no_model.pt"
    torch.save({"epoch": 1}, no_model)
    with pytest.raises(CheckpointError, match="no 'model' state dict"):
        load_checkpoint(no_model)


def test_bare_state_dict_file_loads(tmp_path):
    mae = build_mae(TINY)
    path = tmp_path / "bare.pth"
    torch.save(mae.state_dict(), path)
    assert torch.equal(load_mae(path, model_config=TINY).mask_token, mae.mask_token)
