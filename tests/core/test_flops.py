"""The MAE's training compute: a hand count on a tiny model, torch's own count of the matrix products, and
the images seen with augmentation multiplicity."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vip_core.config import ModelConfig, TrainingConfig, vip_pico
from vip_core.models import build_mae
from vip_core.models.flops import mae_forward_flops, stage_flops, training_flops

# 8 px, patch 4: 4 patches, 1 kept at mask 0.75; encoder 1 block of 8 (MLP 32), decoder 1 block of 4 (MLP 16).
TINY = ModelConfig(img_size=8, patch_size=4, embed_dim=8, depth=1, num_heads=2, decoder_embed_dim=4,
                   decoder_depth=1, decoder_num_heads=2, mask_ratio=0.75)


def test_one_images_forward_flops_match_a_hand_count():
    patch_embed = 2 * 4 * 48 * 8  # every patch: 48 pixels -> 8
    encoder = 2 * 2 * (3 * 64 + 64 + 2 * 8 * 32) + 4 * 2 * 2 * 8  # 2 tokens: qkv, proj, fc1 + fc2; q kᵀ and a v
    decoder_embed = 2 * 2 * 8 * 4
    decoder = 2 * 5 * (3 * 16 + 16 + 2 * 4 * 16) + 4 * 5 * 5 * 4  # 5 tokens (class + 4 patches) of width 4
    prediction = 2 * 5 * 4 * 48
    assert mae_forward_flops(TINY) == patch_embed + encoder + decoder_embed + decoder + prediction == 10_640


def test_the_linear_layers_agree_with_torchs_count_on_the_pico_model():
    model = vip_pico().model
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        build_mae(model)(torch.randn(2, 3, model.img_size, model.img_size))
    attention = 4 * (model.depth * 17 ** 2 * model.embed_dim + model.decoder_depth * 65 ** 2 * model.decoder_embed_dim)
    assert counter.get_total_flops() / 2 == mae_forward_flops(model) - attention  # torch's CPU attention goes uncounted


def test_training_counts_forward_and_backward_for_every_image_seen_each_multiplicity_times():
    assert training_flops(TINY, images=10) == 3 * 10_640 * 10
    assert training_flops(TINY, images=10, multiplicity=4) == 4 * training_flops(TINY, images=10)
    stage = TrainingConfig(batch_size=64, physical_batch_size=64, steps=5)
    assert stage_flops(TINY, stage) == training_flops(TINY, images=5 * 64)


@pytest.mark.parametrize("multiplicity, batch", [(2, 32), (4, 16)])
def test_multiplicity_k_at_a_k_times_smaller_batch_costs_the_same(multiplicity, batch):
    assert training_flops(TINY, images=batch * 5, multiplicity=multiplicity) == training_flops(TINY, images=64 * 5)
    stage = TrainingConfig(batch_size=batch, physical_batch_size=batch, steps=5, augmentation_multiplicity=multiplicity)
    assert stage_flops(TINY, stage) == training_flops(TINY, images=64 * 5)
