"""The fitting pieces the evaluation jobs share: layer-wise learning-rate decay of the optimiser groups."""

from __future__ import annotations

from vip_core.config import tiny
from vip_core.eval.finetune import EncoderClassifier
from vip_core.eval.optim import layer_decay_param_groups
from vip_core.models import build_encoder


def test_layer_decay_gives_the_head_full_lr_and_earlier_blocks_less():
    model = EncoderClassifier(build_encoder(tiny().model), num_classes=3)
    depth = len(model.encoder.blocks)
    groups = layer_decay_param_groups(model, "encoder.", depth, lr=1.0, weight_decay=0.05, layer_decay=0.5)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    decay_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert lr_of[id(model.head.weight)] == 1.0
    assert lr_of[id(model.encoder.blocks[-1].mlp.fc1.weight)] == 0.5
    assert lr_of[id(model.encoder.blocks[0].mlp.fc1.weight)] == 0.5 ** depth
    assert lr_of[id(model.encoder.patch_embed.proj.weight)] == 0.5 ** (depth + 1)
    assert decay_of[id(model.encoder.blocks[0].mlp.fc1.weight)] == 0.05
    assert decay_of[id(model.encoder.blocks[0].mlp.fc1.bias)] == 0.0
    assert decay_of[id(model.encoder.cls_token)] == 0.0
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert set(lr_of) == trainable, "every trainable parameter is in exactly one group"
