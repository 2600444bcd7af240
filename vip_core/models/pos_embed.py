"""Fixed 2-D sine-cosine position embeddings, laid out as in the released MAE and ViP checkpoints.

For a ``grid_size x grid_size`` grid of patches (row-major, the order of ``PatchEmbed``'s tokens), the
first half of the channels encodes the patch's column and the second half its row; each half is
``[sin(pos * omega_k) for k] + [cos(pos * omega_k) for k]`` with ``omega_k = 10000 ** (-k / (D / 4))``.
An optional all-zero row in front is the class token's embedding.
"""

from __future__ import annotations

import torch


def get_1d_sincos_pos_embed(embed_dim: int, positions: torch.Tensor) -> torch.Tensor:
    """Sine-cosine embedding of 1-D positions.

    Args:
        embed_dim: channels of the output; must be even.
        positions: positions of any shape; they are flattened.

    Returns:
        ``[M, embed_dim]`` float64 embedding: sines in the first half, cosines in the second.
    """
    if embed_dim % 2:
        raise ValueError(f"sin-cos position embedding: embed_dim must be even, got {embed_dim}")
    omega = torch.arange(embed_dim // 2, dtype=torch.float64) / (embed_dim / 2.0)  # omega: [D/2]
    omega = 1.0 / 10000**omega
    angles = positions.reshape(-1).to(torch.float64)[:, None] * omega[None, :]  # angles: [M, D/2]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)  # [M, D]


def get_2d_sincos_pos_embed(embed_dim: int, grid_size: int, cls_token: bool = False) -> torch.Tensor:
    """Sine-cosine embedding of a square grid of patches.

    Args:
        embed_dim: channels of the output; must be a multiple of 4.
        grid_size: patches per side.
        cls_token: put an all-zero row in front for the class token.

    Returns:
        ``[grid_size**2 (+1), embed_dim]`` float32 embedding, one row per token.
    """
    if embed_dim % 4:
        raise ValueError(f"2-D sin-cos position embedding: embed_dim must be a multiple of 4, got {embed_dim}")
    coords = torch.arange(grid_size, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")  # rows, cols: [G, G]
    embed = torch.cat(
        [get_1d_sincos_pos_embed(embed_dim // 2, cols), get_1d_sincos_pos_embed(embed_dim // 2, rows)], dim=1
    )  # embed: [G*G, D]
    if cls_token:
        embed = torch.cat([torch.zeros(1, embed_dim, dtype=embed.dtype), embed], dim=0)  # [1+G*G, D]
    return embed.float()
