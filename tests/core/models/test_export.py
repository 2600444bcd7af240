"""Exported weights load where the model card says: strictly in timm with vip's features, in the official MAE
layout, and as safetensors; the card carries the checkpoint's ledger, or says that there is none."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import timm
import torch
from timm.models.vision_transformer import VisionTransformer

from tests.core.models.test_checkpoint import released_mae_shapes
from vip_core.config import get_preset
from vip_core.models import CheckpointError, build_mae, export_encoder, save_checkpoint
from vip_core.models.checkpoint import PUBLISHED_ENTRIES
from vip_core.models.export import export_checkpoint
from vip_core.models.mae import LAYER_NORM
from vip_core.privacy.ledger import PrivacyLedger

TINY = get_preset("tiny")
STEP = 3


@pytest.fixture(scope="module")
def mae():
    torch.manual_seed(0)
    return build_mae(TINY.model).eval()


@pytest.fixture(scope="module")
def ledger():
    return PrivacyLedger(noise_multiplier=1.1, sample_rate=0.1, delta=1e-5, accountant="pld", steps=STEP)


@pytest.fixture(scope="module")
def published(mae, ledger, tmp_path_factory):
    """A checkpoint as pre-training publishes it: exactly the weights, the config, the step, the ledger and no EMA."""
    folder = tmp_path_factory.mktemp("published")
    save_checkpoint(folder, model=mae, config=TINY, step=STEP, ledger=ledger.summary(), ema=None)
    assert tuple(torch.load(folder / "checkpoint.pt", weights_only=True)) == PUBLISHED_ENTRIES
    return folder


def images(n: int = 3) -> torch.Tensor:
    return torch.rand(n, 3, TINY.model.img_size, TINY.model.img_size, generator=torch.Generator().manual_seed(5))


def timm_encoder(card: dict, file, **overrides) -> VisionTransformer:
    """The card's ``timm.create_model`` call, with the weights file at its full path."""
    recipe = card["timm"]
    overlay = {**recipe["pretrained_cfg_overlay"], "file": str(file)}
    return timm.create_model(recipe["model_name"], pretrained=True, pretrained_cfg_overlay=overlay, num_classes=0,
                             **{**recipe["kwargs"], **overrides}).eval()


@pytest.mark.parametrize(("fmt", "name"), [("timm", "encoder.pth"), ("safetensors", "encoder.safetensors")])
def test_timm_loads_every_weight_and_gives_vips_features(published, mae, tmp_path, fmt, name):
    written = export_checkpoint(published, fmt, tmp_path / name)
    encoder = timm_encoder(written["card"], written["output"])
    recipe = written["card"]["timm"]
    plain = timm.create_model(recipe["model_name"], pretrained=True, pretrained_cfg_overlay=dict(file=written["output"]),
                              num_classes=0, **recipe["kwargs"]).eval()  # without the card's overlay
    reference = export_encoder(mae).eval()
    assert encoder.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(value, reference.state_dict()[key]) for key, value in encoder.state_dict().items())
    assert all(torch.equal(value, reference.state_dict()[key]) for key, value in plain.state_dict().items())
    with torch.no_grad():
        assert torch.equal(encoder.forward_features(images()), reference.forward_features(images()))
        assert torch.equal(encoder(images()), reference(images()))  # the class token, after the final norm
        # Mean pooling keeps the final norm where the MAE has it only with fc_norm=False, as the card says.
        averaged = timm_encoder(written["card"], written["output"], global_pool="avg")
        torch.testing.assert_close(averaged(images()), export_encoder(mae, global_pool="avg")(images()))


def test_the_call_written_in_the_card_loads_strictly(published, tmp_path):
    written = export_checkpoint(published, "timm", tmp_path / "encoder.pth")
    call = written["card"]["timm"]["call"]
    assert call.startswith("timm.create_model('vit_base_patch16_224', pretrained=True")
    assert "fc_norm=False" in call and "num_classes=0" in call
    encoder = eval(call.replace("'encoder.pth'", repr(written["output"])), {"timm": timm})
    assert isinstance(encoder, VisionTransformer)
    # Strict: a file that lacks one of the encoder's weights is refused, not filled with a random initialisation.
    state = torch.load(written["output"], weights_only=True)
    del state["blocks.1.mlp.fc2.weight"]
    torch.save(state, written["output"])
    with pytest.raises(RuntimeError, match="blocks.1.mlp.fc2.weight"):
        eval(call.replace("'encoder.pth'", repr(written["output"])), {"timm": timm})


def test_the_mae_format_has_the_official_layout(published, mae, tmp_path):
    written = export_checkpoint(published, "mae", tmp_path / "vip-mae.pth")
    state = torch.load(written["output"], weights_only=True)["model"]
    model = TINY.model
    official = released_mae_shapes(dim=model.embed_dim, depth=model.depth, dec_dim=model.decoder_embed_dim,
                                   dec_depth=model.decoder_depth, tokens=model.num_patches + 1, patch=model.patch_size)
    assert {key: tuple(value.shape) for key, value in state.items()} == official
    assert all(torch.equal(value, mae.state_dict()[key]) for key, value in state.items())
    # facebookresearch/mae's fine-tuning builds a timm ViT with a head, loads the file's "model" non-strictly and
    # requires that only the head be missing; the decoder's keys are left over.
    vit = VisionTransformer(img_size=model.img_size, patch_size=model.patch_size, embed_dim=model.embed_dim,
                            depth=model.depth, num_heads=model.num_heads, mlp_ratio=model.mlp_ratio, qkv_bias=True,
                            norm_layer=LAYER_NORM, num_classes=10).eval()
    missing, unexpected = vit.load_state_dict(state, strict=False)
    assert set(missing) == {"head.weight", "head.bias"}
    assert all(key.startswith(("decoder_", "mask_token")) for key in unexpected)
    with torch.no_grad():
        assert torch.equal(vit.forward_features(images()), export_encoder(mae).forward_features(images()))
    assert written["card"]["timm"] is None


def test_safetensors_round_trip_and_carry_the_timm_arguments(published, mae, tmp_path):
    written = export_checkpoint(published, "safetensors", tmp_path / "encoder.safetensors")
    state = safetensors.torch.load_file(written["output"])
    expected = export_encoder(mae).state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[key], expected[key]) for key in state)
    with safetensors.safe_open(written["output"], framework="pt") as handle:
        metadata = handle.metadata()
    assert json.loads(metadata["timm_kwargs"]) == written["card"]["timm"]["kwargs"]
    assert metadata["timm_model_name"] == written["card"]["timm"]["model_name"]


def test_the_card_carries_the_ledger_and_what_it_covers(published, ledger, tmp_path):
    written = export_checkpoint(published, "timm", tmp_path / "encoder.pth")
    card = json.loads((tmp_path / "encoder.json").read_text())
    assert written["card_json"] == str(tmp_path / "encoder.json")
    privacy = card["privacy"]
    summary = ledger.summary()
    for key in ("epsilon", "delta", "noise_multiplier", "sample_rate", "steps", "accountant", "composed_with"):
        assert privacy[key] == summary[key], key
    assert privacy["adjacency"] == "zero-out" and privacy["private_statistics_logged"] is False
    assert "allow-list" in privacy["covers"] and "without noise" in privacy["not_covered"]
    assert card["data"]["fingerprint"] is None  # a digest of the private data is never published
    assert card["model"]["training_step"] == STEP and card["model"]["embed_dim"] == TINY.model.embed_dim
    markdown = (tmp_path / "encoder.md").read_text()
    assert f"({summary['epsilon']:.4g}, 1e-05)-differential privacy" in markdown
    assert card["timm"]["call"] in markdown and card["sha256"] in markdown


def test_a_checkpoint_without_a_ledger_says_so(mae, tmp_path):
    save_checkpoint(tmp_path / "synthetic", model=mae, config=TINY, step=STEP, ledger=None)
    written = export_checkpoint(tmp_path / "synthetic", "timm", tmp_path / "encoder.pth")
    assert written["card"]["privacy"] is None
    assert "no privacy guarantee" in (tmp_path / "encoder.md").read_text()


def test_a_training_checkpoint_is_exported_with_its_ledger(mae, ledger, tmp_path):
    # A training checkpoint keeps its ledger inside the training step's state, not beside the weights.
    save_checkpoint(tmp_path / "training", model=mae, config=TINY, step=STEP, stage="private",
                    state={"ledger": ledger.state_dict(), "optimizer": {}})
    written = export_checkpoint(tmp_path / "training", "timm", tmp_path / "encoder.pth")
    assert written["card"]["privacy"]["epsilon"] == pytest.approx(ledger.epsilon)


def test_bad_input_is_refused_and_nothing_is_overwritten(published, mae, tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        export_checkpoint(tmp_path / "nowhere", "timm", tmp_path / "a.pth")
    torch.save({"model": mae.state_dict()}, tmp_path / "released.pth")  # the official MAE's own file: no vip config
    with pytest.raises(CheckpointError, match="not a vip checkpoint"):
        export_checkpoint(tmp_path / "released.pth", "timm", tmp_path / "a.pth")
    with pytest.raises(ValueError, match="unknown format 'onnx'"):
        export_checkpoint(published, "onnx", tmp_path / "a.onnx")
    with pytest.raises(ValueError, match="ending in .safetensors"):
        export_checkpoint(published, "safetensors", tmp_path / "a.pth")
    (tmp_path / "kept.pth").write_text("a user's file")
    with pytest.raises(ValueError, match="exists"):
        export_checkpoint(published, "timm", tmp_path / "kept.pth")
    assert (tmp_path / "kept.pth").read_text() == "a user's file"
    assert not (tmp_path / "a.pth").exists() and not (tmp_path / "a.json").exists()
