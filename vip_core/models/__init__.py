"""Models: the masked autoencoder, its encoder as a timm ViT, and checkpoints."""

from vip_core.models.checkpoint import CheckpointError, load_checkpoint, load_encoder, load_mae, save_checkpoint
from vip_core.models.mae import (
    MaskedAutoencoderViT,
    build_encoder,
    build_mae,
    encoder_state_dict,
    export_encoder,
    patchify,
    unpatchify,
)
from vip_core.models.pos_embed import get_2d_sincos_pos_embed

__all__ = [
    "CheckpointError",
    "MaskedAutoencoderViT",
    "build_encoder",
    "build_mae",
    "encoder_state_dict",
    "export_encoder",
    "get_2d_sincos_pos_embed",
    "load_checkpoint",
    "load_encoder",
    "load_mae",
    "patchify",
    "save_checkpoint",
    "unpatchify",
]
