"""Training compute of the masked autoencoder in FLOPs, from the model's configuration alone.

One image's forward pass counts the matrix products (2 FLOPs a multiply-add): the patch embedding of every
patch, the encoder's blocks on the class token and the kept patches, the decoder's embedding, blocks and
prediction on the class token and every patch. A block of width ``D`` on ``T`` tokens costs ``2 T (4 + 2 r) D²``
(q, k, v, the projection and the MLP of ratio ``r``) plus ``4 T² D`` (the attention's two products);
norms, softmax and the loss are left out (under 1 % here). The backward pass counts twice the forward, the
usual convention, so one image trained costs three forward passes.
"""

from __future__ import annotations

from vip_core.config import ModelConfig, TrainingConfig

BACKWARD_FACTOR = 2  # backward ≈ 2 x forward: gradients of the activations and of the weights


def block_flops(tokens: int, width: int, mlp_ratio: float) -> int:
    """One transformer block's forward FLOPs on ``tokens`` tokens of ``width``."""
    hidden = int(width * mlp_ratio)
    projections = 2 * tokens * (4 * width * width + 2 * width * hidden)  # q, k, v, proj; fc1, fc2
    attention = 2 * 2 * tokens * tokens * width  # q kᵀ and the weighted sum of v
    return projections + attention


def mae_forward_flops(model: ModelConfig) -> int:
    """One image's MAE forward FLOPs (encoder on the kept patches, decoder on every patch)."""
    patches = (model.img_size // model.patch_size) ** 2
    kept = int(patches * (1 - model.mask_ratio))  # as MaskedAutoencoderViT.random_masking keeps
    patch_pixels = model.patch_size ** 2 * model.in_chans
    embed = 2 * patches * patch_pixels * model.embed_dim  # the patch embedding runs before the masking
    encoder = model.depth * block_flops(1 + kept, model.embed_dim, model.mlp_ratio)
    decoder_embed = 2 * (1 + kept) * model.embed_dim * model.decoder_embed_dim
    decoder = model.decoder_depth * block_flops(1 + patches, model.decoder_embed_dim, model.mlp_ratio)
    prediction = 2 * (1 + patches) * model.decoder_embed_dim * patch_pixels
    return embed + encoder + decoder_embed + decoder + prediction


def training_flops(model: ModelConfig, images: int, multiplicity: int = 1) -> int:
    """FLOPs of training on ``images`` images (forward and backward), each seen ``multiplicity`` times per step
    (augmentation multiplicity: that many masks and crops of one image inside its own loss)."""
    return (1 + BACKWARD_FACTOR) * mae_forward_flops(model) * multiplicity * images


def stage_flops(model: ModelConfig, training: TrainingConfig) -> int:
    """FLOPs of one pre-training stage: ``steps`` x the expected batch ``batch_size`` images, each seen as often
    as the stage's augmentation multiplicity says."""
    return training_flops(model, training.steps * training.batch_size, training.augmentation_multiplicity)
