"""The masked autoencoder (MAE) on timm blocks, and its encoder as a timm ``VisionTransformer``.

The module layout and state-dict keys follow facebookresearch/mae ``models_mae.py`` (also used by
facebookresearch/ViP-MAE), so released ``.pth`` files load: ``patch_embed.proj``, ``cls_token``,
``pos_embed``, ``blocks.N``, ``norm``, ``decoder_embed``, ``mask_token``, ``decoder_pos_embed``,
``decoder_blocks.N``, ``decoder_norm``, ``decoder_pred``.

Two departures, both for differentially private training, where each sample's gradient is computed
(and clipped) on its own:

* the loss is one value per sample, the mean squared error over that sample's masked patches, so a
  sample's loss depends on no other sample;
* the masking noise can be passed in (``noise``) or drawn from a ``generator``, and the tokens with a
  leading batch dimension of 1 (``cls_token``, ``mask_token``, the position embeddings) are only ever
  broadcast against the batch (``expand``, broadcast adds), never copied with ``repeat``.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from vip_core.config import ModelConfig
from vip_core.models.pos_embed import get_2d_sincos_pos_embed

LAYER_NORM = partial(nn.LayerNorm, eps=1e-6)
GlobalPool = Literal["token", "avg"]


def patchify(imgs: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Cuts square images into flattened patches, row-major, each patch ``(row, col, channel)``-ordered.

    Args:
        imgs: ``[N, C, H, W]`` images with ``H == W`` a multiple of ``patch_size``.
        patch_size: side of a patch in pixels.

    Returns:
        ``[N, L, patch_size**2 * C]`` patches, ``L = (H / patch_size)**2``.
    """
    n, c, h, w = imgs.shape
    if h != w or h % patch_size:
        raise ValueError(f"patchify: images must be square with a side divisible by {patch_size}, got {h}x{w}")
    g = h // patch_size
    x = imgs.reshape(n, c, g, patch_size, g, patch_size)  # x: [N, C, G, p, G, p]
    x = torch.einsum("nchpwq->nhwpqc", x)  # x: [N, G, G, p, p, C]
    return x.reshape(n, g * g, patch_size * patch_size * c)  # [N, L, p*p*C]


def unpatchify(x: torch.Tensor, patch_size: int, in_chans: int = 3) -> torch.Tensor:
    """Inverse of :func:`patchify`.

    Args:
        x: ``[N, L, patch_size**2 * in_chans]`` patches, ``L`` a square number.
        patch_size: side of a patch in pixels.
        in_chans: image channels.

    Returns:
        ``[N, in_chans, H, W]`` images.
    """
    n, num_patches, _ = x.shape
    g = int(round(num_patches**0.5))
    if g * g != num_patches or x.shape[2] != patch_size * patch_size * in_chans:
        raise ValueError(f"unpatchify: cannot form a square image of {patch_size}px patches from {tuple(x.shape)}")
    x = x.reshape(n, g, g, patch_size, patch_size, in_chans)  # x: [N, G, G, p, p, C]
    x = torch.einsum("nhwpqc->nchpwq", x)  # x: [N, C, G, p, G, p]
    return x.reshape(n, in_chans, g * patch_size, g * patch_size)  # [N, C, H, W]


class MaskedAutoencoderViT(nn.Module):
    """Masked autoencoder with a ViT encoder and a light ViT decoder (He et al., 2022).

    Args:
        img_size: side of the square input images.
        patch_size: side of a patch.
        in_chans: image channels.
        embed_dim: encoder width.
        depth: encoder blocks.
        num_heads: encoder attention heads.
        decoder_embed_dim: decoder width.
        decoder_depth: decoder blocks.
        decoder_num_heads: decoder attention heads.
        mlp_ratio: MLP hidden width over block width.
        mask_ratio: fraction of patches masked when ``forward`` is given none.
        norm_pix_loss: regress each patch's pixels normalised by that patch's mean and variance.
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 4,
        decoder_num_heads: int = 16,
        mlp_ratio: float = 4.0,
        mask_ratio: float = 0.75,
        norm_pix_loss: bool = False,
    ) -> None:
        super().__init__()
        self.config = ModelConfig(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim, depth=depth,
            num_heads=num_heads, decoder_embed_dim=decoder_embed_dim, decoder_depth=decoder_depth,
            decoder_num_heads=decoder_num_heads, mlp_ratio=mlp_ratio, mask_ratio=mask_ratio,
            norm_pix_loss=norm_pix_loss,
        )
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.mask_ratio = mask_ratio
        self.norm_pix_loss = norm_pix_loss
        num_patches = self.config.num_patches

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim), requires_grad=False)
        self.blocks = nn.ModuleList(
            [Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=LAYER_NORM) for _ in range(depth)]
        )
        self.norm = LAYER_NORM(embed_dim)

        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim, bias=True)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, decoder_embed_dim), requires_grad=False)
        self.decoder_blocks = nn.ModuleList(
            [
                Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True, norm_layer=LAYER_NORM)
                for _ in range(decoder_depth)
            ]
        )
        self.decoder_norm = LAYER_NORM(decoder_embed_dim)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size**2 * in_chans, bias=True)

        self.initialize_weights()

    @property
    def num_patches(self) -> int:
        return self.config.num_patches

    def initialize_weights(self) -> None:
        """MAE's initialisation: sin-cos position embeddings, Xavier-uniform linear layers and patch
        projection, N(0, 0.02) class and mask tokens, unit LayerNorms."""
        grid = self.config.img_size // self.patch_size
        with torch.no_grad():
            self.pos_embed.copy_(get_2d_sincos_pos_embed(self.pos_embed.shape[-1], grid, cls_token=True)[None])
            self.decoder_pos_embed.copy_(
                get_2d_sincos_pos_embed(self.decoder_pos_embed.shape[-1], grid, cls_token=True)[None]
            )
        init_vit_weights(self)
        nn.init.normal_(self.mask_token, std=0.02)

    def patchify(self, imgs: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` images to ``[N, L, p*p*C]`` patches."""
        return patchify(imgs, self.patch_size)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, L, p*p*C]`` patches to ``[N, C, H, W]`` images."""
        return unpatchify(x, self.patch_size, self.in_chans)

    def masking_noise(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Uniform noise that decides the mask, one independent row per sample.

        Args:
            batch_size: samples.
            generator: source of randomness; its device is used, else the model's.

        Returns:
            ``[batch_size, L]`` noise on the model's device: the lowest ``len_keep`` entries of a row are kept.
        """
        device = generator.device if generator is not None else self.cls_token.device
        noise = torch.rand(batch_size, self.num_patches, generator=generator, device=device)  # noise: [N, L]
        return noise.to(self.cls_token.device)

    def random_masking(
        self, x: torch.Tensor, mask_ratio: float, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-sample random masking: each sample keeps the ``int(L * (1 - mask_ratio))`` patches with the
        lowest noise, as many as facebookresearch/mae keeps, so a ratio that leaves a fraction of a patch
        keeps the same count in both.

        Args:
            x: ``[N, L, D]`` patch tokens.
            mask_ratio: fraction of patches to mask, in ``[0, 1)``.
            noise: ``[N, L]`` noise that ranks each sample's patches.

        Returns:
            The kept tokens ``[N, len_keep, D]`` in noise order, the mask ``[N, L]`` (1 masked, 0 kept)
            and ``ids_restore`` ``[N, L]``, the rank of each patch in that order.
        """
        n, num_patches, dim = x.shape
        if not 0.0 <= mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must lie in [0, 1), got {mask_ratio}")
        if noise.shape != (n, num_patches):
            raise ValueError(f"noise must have shape {(n, num_patches)}, got {tuple(noise.shape)}")
        len_keep = int(num_patches * (1 - mask_ratio))
        ids_shuffle = torch.argsort(noise, dim=1)  # ids_shuffle: [N, L], ascending: the first are kept
        ids_restore = torch.argsort(ids_shuffle, dim=1)  # ids_restore: [N, L]
        ids_keep = ids_shuffle[:, :len_keep]  # ids_keep: [N, len_keep]
        x_kept = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, dim))  # x_kept: [N, len_keep, D]
        mask = (ids_restore >= len_keep).to(x.dtype)  # mask: [N, L]
        return x_kept, mask, ids_restore

    def forward_encoder(
        self,
        imgs: torch.Tensor,
        mask_ratio: float,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encodes the visible patches.

        Args:
            imgs: ``[N, C, H, W]`` images.
            mask_ratio: fraction of patches to mask.
            noise: ``[N, L]`` masking noise; drawn with :meth:`masking_noise` when absent.
            generator: source of the masking noise when ``noise`` is absent.

        Returns:
            The latent ``[N, 1 + len_keep, D]`` (class token first), the mask ``[N, L]`` and ``ids_restore``.
        """
        self._check_images(imgs)
        if noise is None:
            noise = self.masking_noise(imgs.shape[0], generator)
        x = self.patch_embed(imgs)  # x: [N, L, D]
        x = x + self.pos_embed[:, 1:, :]  # x: [N, L, D]
        x, mask, ids_restore = self.random_masking(x, mask_ratio, noise)  # x: [N, len_keep, D]
        cls_token = self.cls_token + self.pos_embed[:, :1, :]  # cls_token: [1, 1, D]
        x = torch.cat([cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # x: [N, 1 + len_keep, D]
        for block in self.blocks:
            x = block(x)
        return self.norm(x), mask, ids_restore

    def forward_decoder(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """Reconstructs every patch from the latent of the visible ones.

        Args:
            latent: ``[N, 1 + len_keep, D]`` encoder output.
            ids_restore: ``[N, L]`` rank of each patch in the masking order.

        Returns:
            ``[N, L, p*p*C]`` predicted pixels.
        """
        x = self.decoder_embed(latent)  # x: [N, 1 + len_keep, Dd]
        n, visible, dim = x.shape
        num_masked = ids_restore.shape[1] + 1 - visible
        mask_tokens = self.mask_token.expand(n, num_masked, -1)  # mask_tokens: [N, L - len_keep, Dd]
        patches = torch.cat([x[:, 1:, :], mask_tokens], dim=1)  # patches: [N, L, Dd], in noise order
        patches = torch.gather(patches, 1, ids_restore.unsqueeze(-1).expand(-1, -1, dim))  # [N, L, Dd], image order
        x = torch.cat([x[:, :1, :], patches], dim=1)  # x: [N, 1 + L, Dd]
        x = x + self.decoder_pos_embed  # x: [N, 1 + L, Dd]
        for block in self.decoder_blocks:
            x = block(x)
        x = self.decoder_pred(self.decoder_norm(x))  # x: [N, 1 + L, p*p*C]
        return x[:, 1:, :]  # [N, L, p*p*C]

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-sample reconstruction loss: each sample's mean squared pixel error over its masked patches.

        Args:
            imgs: ``[N, C, H, W]`` images.
            pred: ``[N, L, p*p*C]`` predicted pixels.
            mask: ``[N, L]``, 1 for masked patches.

        Returns:
            ``[N]`` losses in float32; a sample with no masked patch has loss 0.
        """
        target = self.patchify(imgs).float()  # target: [N, L, p*p*C]
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)  # mean: [N, L, 1]
            var = target.var(dim=-1, keepdim=True)  # var: [N, L, 1]
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        per_patch = ((pred.float() - target) ** 2).mean(dim=-1)  # per_patch: [N, L]
        mask = mask.float()
        return (per_patch * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)  # [N]

    def forward(
        self,
        imgs: torch.Tensor,
        mask_ratio: float | None = None,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Masks, encodes, decodes and scores a batch.

        Args:
            imgs: ``[N, C, H, W]`` images.
            mask_ratio: fraction of patches to mask; the model's ``mask_ratio`` when None.
            noise: ``[N, L]`` masking noise, for reproducible masks; drawn when None.
            generator: source of the masking noise when ``noise`` is None.

        Returns:
            ``(loss [N], pred [N, L, p*p*C], mask [N, L])``: one loss per sample, the predicted
            patches, and the mask (1 masked, 0 kept).
        """
        ratio = self.mask_ratio if mask_ratio is None else mask_ratio
        latent, mask, ids_restore = self.forward_encoder(imgs, ratio, noise, generator)
        pred = self.forward_decoder(latent, ids_restore)  # pred: [N, L, p*p*C]
        return self.forward_loss(imgs, pred, mask), pred, mask

    def _check_images(self, imgs: torch.Tensor) -> None:
        expected = (self.in_chans, self.config.img_size, self.config.img_size)
        if imgs.dim() != 4 or tuple(imgs.shape[1:]) != expected:
            raise ValueError(f"images must have shape [N, {', '.join(map(str, expected))}], got {list(imgs.shape)}")


def init_vit_weights(model: nn.Module) -> None:
    """MAE's initialisation of a ViT's learned weights (position embeddings are left alone).

    Xavier-uniform for the patch projection (viewed as a linear layer) and every linear layer, zero
    biases, unit LayerNorms, N(0, 0.02) class token.
    """
    projection = model.patch_embed.proj.weight
    with torch.no_grad():
        nn.init.xavier_uniform_(projection.view(projection.shape[0], -1))
    nn.init.normal_(model.cls_token, std=0.02)
    model.apply(_init_linear_and_norm)


def _init_linear_and_norm(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.xavier_uniform_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def build_mae(model_cfg: ModelConfig) -> MaskedAutoencoderViT:
    """A freshly initialised MAE of the configured size (uses torch's global random state)."""
    return MaskedAutoencoderViT(**model_cfg.model_dump())


def _vision_transformer(model_cfg: ModelConfig, num_classes: int, global_pool: GlobalPool) -> VisionTransformer:
    """A timm ViT shaped like the MAE encoder. The final LayerNorm stays in ``forward_features`` for
    both poolings (``fc_norm=False``), so its features equal the MAE encoder's output."""
    if global_pool not in ("token", "avg"):
        raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
    return VisionTransformer(
        img_size=model_cfg.img_size,
        patch_size=model_cfg.patch_size,
        in_chans=model_cfg.in_chans,
        num_classes=num_classes,
        global_pool=global_pool,
        embed_dim=model_cfg.embed_dim,
        depth=model_cfg.depth,
        num_heads=model_cfg.num_heads,
        mlp_ratio=model_cfg.mlp_ratio,
        qkv_bias=True,
        class_token=True,
        fc_norm=False,
        norm_layer=LAYER_NORM,
    )


def build_encoder(model_cfg: ModelConfig, num_classes: int = 0, global_pool: GlobalPool = "token") -> VisionTransformer:
    """A randomly initialised timm ``VisionTransformer`` of the MAE encoder's size: the untrained baseline.

    It is initialised as the MAE is (fixed sin-cos position embedding, Xavier-uniform weights).

    Args:
        model_cfg: the model's size.
        num_classes: classifier outputs; 0 gives no head (``forward`` returns the pooled features).
        global_pool: ``"token"`` pools the class token, ``"avg"`` averages the patch tokens; both
            after the encoder's final LayerNorm.
    """
    vit = _vision_transformer(model_cfg, num_classes, global_pool)
    grid = model_cfg.img_size // model_cfg.patch_size
    with torch.no_grad():
        vit.pos_embed.copy_(get_2d_sincos_pos_embed(model_cfg.embed_dim, grid, cls_token=True)[None])
    init_vit_weights(vit)
    return vit


def export_encoder(mae: MaskedAutoencoderViT, num_classes: int = 0, global_pool: GlobalPool = "token") -> VisionTransformer:
    """The MAE's encoder as a timm ``VisionTransformer``, for evaluation and fine-tuning.

    ``forward_features`` of the result on an image equals the MAE encoder's output with nothing masked.
    The default ``global_pool="token"`` pools the normalised class token, MAE's linear-probe protocol;
    ``"avg"`` averages the normalised patch tokens. The position embedding is copied and, as in timm
    (and MAE fine-tuning), trainable in the result. A head (``num_classes > 0``) is freshly initialised.

    Args:
        mae: the trained masked autoencoder.
        num_classes: classifier outputs; 0 gives no head.
        global_pool: ``"token"`` or ``"avg"``.
    """
    vit = _vision_transformer(mae.config, num_classes, global_pool)
    missing, unexpected = vit.load_state_dict(encoder_state_dict(mae.state_dict()), strict=False)
    if unexpected or any(not key.startswith("head.") for key in missing):
        raise RuntimeError(f"export_encoder: layouts differ: missing {missing}, unexpected {unexpected}")
    return vit.to(mae.cls_token.device)


def encoder_state_dict(mae_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The encoder's entries of an MAE state dict; their keys are also a timm ``VisionTransformer``'s."""
    return {key: value for key, value in mae_state.items() if _is_encoder_key(key)}


def _is_encoder_key(key: str) -> bool:
    return key in ("cls_token", "pos_embed") or key.startswith(("patch_embed.", "blocks.", "norm."))
