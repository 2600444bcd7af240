"""Per-sample norms and clipped sums of the supported layers, layers of one shape computed together.

The engine (:mod:`vip_core.privacy.engine`) runs one forward and one backward that computes activation gradients
only, and keeps, for every call of a supported layer, its input ``A`` and output gradient ``G`` (a
:class:`Record`). After the backward, layers whose kept tensors have one shape (a ViT's repeated blocks) form a
group, stacked once: each group adds its samples' squared norms to a :class:`Norms` (ghost norms with their error
bounds; materialised gradients' squares, bounded once all are in), ``[B]`` per quantity, one set of operations per
group instead of one per layer, and returns a
:class:`Sum`, which adds ``Σᵢ fᵢ·gᵢ`` to the gradient buffer once the clip factors ``f`` are known, with the
multiply-adds it costs (:data:`Work`: how the engine shares the sums between threads).

Linear and Conv2d weights choose by book-keeping (Bu et al., 2023) between the ghost norm
``Σ_{t,s} (aₜ·aₛ)(gₜ·gₛ)`` with a clipped sum ``Σᵢ Gᵢᵀ (fᵢ·Aᵢ)`` (one matmul for the group), and materialised
per-sample gradients ``Gᵢᵀ Aᵢ``, whichever costs less: materialising costs no more flops and memory exactly when
``d_in·d_out <= T·(d_in + d_out)``. Biases, LayerNorm parameters and plain ``[1, ...]`` parameters are always
materialised (``[L, B, n]`` float32 "pieces"). The rounding of each computation is bounded as
:mod:`vip_core.privacy.numerics` states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vip_core.privacy import numerics
from vip_core.privacy.numerics import Numerics


def materialise_is_cheaper(tokens: int, d_in: int, d_out: int) -> bool:
    """Whether per-sample weight gradients cost no more (flops and memory) than the ghost norm."""
    return d_in * d_out <= tokens * (d_in + d_out)


@dataclass(eq=False)
class Layer:
    """A supported layer of the model, as planned: its kind (``"matmul"``, ``"layer_norm"``, ``"embedding"``)
    and trainable parameters (None where frozen or absent)."""

    name: str
    module: nn.Module
    kind: str
    weight: nn.Parameter | None
    bias: nn.Parameter | None

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in (self.weight, self.bias) if p is not None]


@dataclass(eq=False)
class Record:
    """What one microbatch kept of one layer: each call's input, the input's version then, and the call's output
    gradient (None until it arrives)."""

    layer: Layer
    inputs: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)


class Norms:
    """A microbatch's per-sample quantities, ``values`` ``[4, B]`` float64: the computed squared norm (for the clip
    factors' shortfall), ``U²`` (it plus its rounding bound), the rounding margin ``M²`` and ``Z``, as
    :func:`~vip_core.privacy.numerics.clip_factors` takes them once :meth:`fold_squares` has run. Materialised
    gradients' squared norms are gathered apart (``squares``, with the number of entries they sum) and folded in with
    their bound once: the bound is linear in both, so one bound of the total is the sum of the pieces' bounds."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.values = torch.zeros(4, batch, dtype=torch.float64, device=device)
        self.squares: torch.Tensor | None = None  # squares: [B] float64
        self.square_entries = 0

    def add(self, terms: torch.Tensor, rows: int = 1) -> None:
        """Adds ``terms`` ``[4, L·B·rows]`` (layer, sample, row; as the rows of :attr:`values`) per sample."""
        self.values += terms.view(4, -1, self.values.shape[1], rows).sum((1, 3))

    def add_squares(self, squares: torch.Tensor, entries: int) -> None:
        """Adds materialised gradients' squared norms ``[B]``, summed in float64 from ``entries`` float32 squares;
        ``squares`` becomes this accumulator's (kept and added to in place): the caller lets it go."""
        self.squares = squares if self.squares is None else self.squares.add_(squares)
        self.square_entries += entries

    def merge(self, other: "Norms") -> None:
        """Moves another accumulator's quantities (a group computed apart) into this one; ``other`` keeps its
        ``values`` but gives up its squares."""
        self.values += other.values
        if other.squares is not None:
            self.add_squares(other.squares, other.square_entries)
            other.squares, other.square_entries = None, 0

    def fold_squares(self) -> None:
        """Adds the gathered squares to the computed squared norm, and they plus their bound to ``U²``."""
        if self.squares is None:
            return
        self.values[0] += self.squares
        self.values[1] += numerics.squares_bound(self.squares, self.square_entries)
        self.squares, self.square_entries = None, 0


# sum(factors [B] float32, 0 for a sample not kept; sanitize: whether a sample was not finite): adds Σᵢ fᵢ·gᵢ
Sum = Callable[[torch.Tensor, bool], None]
Work = tuple[int, Sum]  # a sum and the multiply-adds it costs
AddRows = Callable[[list[nn.Parameter], torch.Tensor], None]  # add_rows(params, values [L, n]) into their sums


def piece(params: list[nn.Parameter], values: torch.Tensor, norms: Norms, add_rows: AddRows) -> Work:
    """Materialised per-sample gradients ``values`` ``[L, B, n]`` float32 of ``params`` (one per leading row):
    their squares summed in float64 into ``norms``; the returned sum adds ``Σᵢ fᵢ·valuesᵢ`` (one batched matvec, the
    non-finite entries of samples not kept, whose factor is 0, cleared first), with its multiply-adds."""
    layers, batch, width = values.shape
    norms.add_squares(torch.sum(values * values, dim=(0, 2), dtype=torch.float64), layers * width)

    def add(factors: torch.Tensor, sanitize: bool) -> None:
        kept = _cleared(values, sanitize)  # kept: [L, B, n]
        add_rows(params, torch.bmm(factors.expand(layers, 1, batch), kept).squeeze(1))  # [L, n]

    return values.numel(), add


# ------------------------------------------------------------------------------------------------ Linear, Conv2d


def matmul_tokens(layer: Layer, inputs: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's ``A: [B, g, T, d_in]`` and ``G: [B, g, T, d_out]`` (``g`` groups of a Conv2d, else 1)."""
    module, batch = layer.module, inputs.shape[0]
    if isinstance(module, nn.Linear):
        acts = inputs.reshape(batch, 1, -1, inputs.shape[-1])  # acts: [B, 1, T, d_in]
        return acts, grads.reshape(batch, 1, -1, grads.shape[-1])
    groups = module.groups
    grads = grads.reshape(batch, groups, grads.shape[1] // groups, -1).transpose(2, 3)  # grads: [B, g, T, d_out]
    if _cuts_patches(module):
        return patches(inputs, module.kernel_size).unsqueeze(1), grads  # acts: [B, 1, T, d_in]
    padding = module._reversed_padding_repeated_twice
    if any(padding):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        inputs = F.pad(inputs, padding, mode=mode)
    unfolded = F.unfold(inputs, module.kernel_size, dilation=module.dilation, stride=module.stride)  # [B, C*k*k, T]
    return unfolded.view(batch, groups, -1, unfolded.shape[-1]).transpose(2, 3), grads  # acts: [B, g, T, d_in]


def _cuts_patches(conv: nn.Conv2d) -> bool:
    """Whether ``conv`` reads non-overlapping patches (a ViT's patch embedding): one group, no padding, no dilation,
    stride equal to the kernel."""
    return (conv.groups == 1 and not any(conv._reversed_padding_repeated_twice) and tuple(conv.dilation) == (1, 1)
            and tuple(conv.stride) == tuple(conv.kernel_size))


def patches(inputs: torch.Tensor, kernel_size: tuple[int, int]) -> torch.Tensor:
    """``F.unfold(inputs, kernel_size, stride=kernel_size)`` laid out token-first, ``[B, T, C·kh·kw]``, by one copy
    (``im2col`` is a slow kernel on CUDA): the same values in the same order."""
    batch, channels, height, width = inputs.shape
    (kh, kw), rows, cols = kernel_size, height // kernel_size[0], width // kernel_size[1]
    cut = inputs[:, :, :rows * kh, :cols * kw].reshape(batch, channels, rows, kh, cols, kw)
    return cut.permute(0, 2, 4, 1, 3, 5).reshape(batch, rows * cols, channels * kh * kw)  # [B, T, C*kh*kw]


def layer_shapes(layer: Layer) -> tuple:
    """The shapes of a layer's trainable weight and bias (None where absent): layers of one group must have the same,
    since their sums are rows of one region of the gradient buffer."""
    return tuple(None if p is None else tuple(p.shape) for p in (layer.weight, layer.bias))


def matmul_key(layer: Layer, acts: torch.Tensor, grads: torch.Tensor) -> tuple:
    """Layers with equal keys are computed as one group."""
    return ("matmul", *acts.shape[1:], grads.shape[3], acts.dtype, grads.dtype, acts.device, *layer_shapes(layer))


def matmul_group(layers: list[Layer], acts: list[torch.Tensor], grads: list[torch.Tensor], numbers: Numerics,
                 norms: Norms, add_rows: AddRows) -> list[Work]:
    """The norms of ``L`` layers of one shape (``acts [B, g, T, d_in]`` and ``grads [B, g, T, d_out]`` each, in the
    dtype they are multiplied in), and their sums: the bias pieces, then the weights' (ghost or materialised)."""
    owned = len(layers) > 1  # a stack is the group's own copy, scaled in place; a single layer's tensors are not
    acts_all, grads_all = _stacked(acts), _stacked(grads)  # [L, B, g, T, d_in], [L, B, g, T, d_out]
    count, batch, groups, tokens, d_in = acts_all.shape
    d_out = grads_all.shape[4]
    sums = []
    if layers[0].bias is not None:
        bias = grads_all.sum(3, dtype=torch.float32).view(count, batch, groups * d_out)  # bias: [L, B, g*d_out]
        sums.append(piece([layer.bias for layer in layers], bias, norms, add_rows))
    weights = [layer.weight for layer in layers if layer.weight is not None]
    if not weights:
        return sums
    acts_rows = acts_all.reshape(-1, tokens, d_in)  # acts_rows: [L*B*g, T, d_in]
    grads_rows = grads_all.reshape(-1, tokens, d_out)  # grads_rows: [L*B*g, T, d_out]
    if materialise_is_cheaper(tokens, d_in, d_out):
        per_sample = numbers.bmm(grads_rows.transpose(1, 2), acts_rows)  # [L*B*g, d_out, d_in]
        sums.append(piece(weights, per_sample.view(count, batch, -1), norms, add_rows))
        return sums
    act_gram = numbers.bmm(acts_rows, acts_rows.transpose(1, 2))  # act_gram: [L*B*g, T, T]
    grad_gram = numbers.bmm(grads_rows, grads_rows.transpose(1, 2))  # grad_gram: [L*B*g, T, T]
    token_norms = torch.stack([torch.linalg.vector_norm(acts_rows, dim=2, dtype=torch.float32),
                               torch.linalg.vector_norm(grads_rows, dim=2, dtype=torch.float32)])  # [2, L*B*g, T]
    terms, scales_acts = numerics.ghost_terms(act_gram, grad_gram, token_norms, d_in, d_out, numbers,
                                              (acts_all.dtype, grads_all.dtype))
    norms.add(terms, groups)

    def add(factors: torch.Tensor, sanitize: bool) -> None:
        shape = (count, batch, groups, 1, 1)
        if isinstance(scales_acts, bool):  # every row scales the same operand; the other is cleared if need be
            scaled = factors.view(1, batch, 1, 1, 1)
            acts_sum = _scaled(acts_all, scaled, owned, sanitize) if scales_acts else _cleared(acts_all, sanitize)
            grads_sum = _cleared(grads_all, sanitize) if scales_acts else _scaled(grads_all, scaled, owned, sanitize)
        else:
            rows = factors.view(1, batch, 1).expand(count, batch, groups).reshape(-1)  # each row's factor: [L*B*g]
            acts_sum = _scaled(acts_all, torch.where(scales_acts, rows, 1.0).view(shape), owned, sanitize)
            grads_sum = _scaled(grads_all, torch.where(scales_acts, 1.0, rows).view(shape), owned, sanitize)
        acts_sum = acts_sum.transpose(1, 2).reshape(count * groups, batch * tokens, d_in)  # [L*g, B*T, d_in]
        grads_sum = grads_sum.transpose(1, 2).reshape(count * groups, batch * tokens, d_out)  # [L*g, B*T, d_out]
        total = numbers.bmm(grads_sum.transpose(1, 2), acts_sum)  # total: [L*g, d_out, d_in]
        add_rows(weights, total.view(count, -1))

    sums.append((count * groups * batch * tokens * d_in * d_out, add))
    return sums


def matmul_norms_work(acts: list[torch.Tensor], grads: list[torch.Tensor]) -> int:
    """The multiply-adds of :func:`matmul_group`'s norms for these calls (``[B, g, T, d_in]`` and ``[B, g, T, d_out]``
    each): the Gram matrices, or the materialised gradients where they cost less."""
    batch, groups, tokens, d_in = acts[0].shape
    d_out = grads[0].shape[3]
    per_token = d_in * d_out if materialise_is_cheaper(tokens, d_in, d_out) else tokens * (d_in + d_out)
    return len(acts) * batch * groups * tokens * per_token


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[L, ...]``: a group's tensors stacked (a copy, after which the list lets the layers' own go), or a single
    layer's as a view."""
    if len(tensors) == 1:
        return tensors[0].unsqueeze(0)
    stacked = torch.stack(tensors)
    tensors.clear()
    return stacked


def _scaled(operand: torch.Tensor, factors: torch.Tensor, owned: bool, sanitize: bool) -> torch.Tensor:
    """``round(f·x)`` in ``operand``'s dtype (the product in float32, rounded once more where the operand is
    bfloat16), in place where the tensor is the group's own; with ``sanitize``, a non-finite entry (only in a sample
    not kept, whose ``f`` is 0) made 0. A factor of 1 leaves an entry exactly as it is."""
    scaled = operand.mul_(factors) if owned else torch.mul(operand, factors, out=torch.empty_like(operand))
    return _cleared(scaled, sanitize, in_place=True)


def _cleared(operand: torch.Tensor, sanitize: bool, in_place: bool = False) -> torch.Tensor:
    """``operand`` with its non-finite entries made 0 where ``sanitize`` (some sample of the microbatch was not
    finite: its factor is 0, and 0 times a non-finite entry is not 0)."""
    if not sanitize:
        return operand
    return operand.nan_to_num_(0.0, 0.0, 0.0) if in_place else operand.nan_to_num(0.0, 0.0, 0.0)


def _token_norms(rows: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` float64 upper bounds on the norms of ``rows``' tokens (``[N, T, d]``), from float32 reductions."""
    return numerics.norm_upper_bounds(torch.linalg.vector_norm(rows, dim=2, dtype=torch.float32), rows.shape[2])


# ------------------------------------------------------------------------------------------------ LayerNorm


def layer_norm_key(layer: Layer, inputs: torch.Tensor, grads: torch.Tensor) -> tuple:
    module = layer.module
    return ("layer_norm", *inputs.shape[1:], grads.dtype, inputs.device, module.eps, *layer_shapes(layer))


def layer_norm_tokens(layer: Layer, inputs: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's input and output gradient as ``[B, T, D]`` float32 (``D`` the normalised size)."""
    width = math.prod(layer.module.normalized_shape)
    batch = inputs.shape[0]
    return inputs.reshape(batch, -1, width).float(), grads.reshape(batch, -1, width).float()


def layer_norm_group(layers: list[Layer], inputs: list[torch.Tensor], grads: list[torch.Tensor], norms: Norms,
                     add_rows: AddRows) -> list[Work]:
    """LayerNorms of one shape: weight gradient ``Σₜ G ⊙ x̂`` and bias gradient ``Σₜ G`` per sample, with ``x̂`` the
    input normalised again (so the norm is taken of the very tensor that is summed)."""
    inputs_all, grads_all = _stacked(inputs), _stacked(grads)  # [L, B, T, D] each
    sums = []
    if layers[0].weight is not None:
        normalized = F.layer_norm(inputs_all, inputs_all.shape[-1:], eps=layers[0].module.eps)  # x̂: [L, B, T, D]
        weight = (grads_all * normalized).sum(2)  # weight: [L, B, D]
        sums.append(piece([layer.weight for layer in layers], weight, norms, add_rows))
    if layers[0].bias is not None:
        sums.append(piece([layer.bias for layer in layers], grads_all.sum(2), norms, add_rows))
    return sums


# ------------------------------------------------------------------------------------------------ Embedding


def embedding(layer: Layer, indices: list[torch.Tensor], grads: list[torch.Tensor], norms: Norms,
              add_rows: AddRows) -> list[Work]:
    """``nn.Embedding``: the per-sample gradient scatters ``G`` rows to the looked-up indices; its squared norm is
    ``Σ_{t,s} [idx_t = idx_s] G_t·G_s``, and the clipped sum one ``index_add`` in float64 (a sample's many tokens on
    one row, summed in float32, could lose more than the norm's bound allows)."""
    module = layer.module
    batch = indices[0].shape[0]
    index = torch.cat([i.reshape(batch, -1) for i in indices], 1)  # index: [B, T]
    rows = torch.cat([g.float().reshape(batch, -1, g.shape[-1]) for g in grads], 1)  # rows: [B, T, D]
    if module.padding_idx is not None:
        rows = rows * (index != module.padding_idx).unsqueeze(-1)
    same = index.unsqueeze(2) == index.unsqueeze(1)  # same: [B, T, T]
    gram = torch.bmm(rows, rows.transpose(1, 2))  # gram: [B, T, T]
    squared = torch.sum(gram.double() * same, dim=(1, 2))  # [B]
    bound = numerics.gram_bound(_token_norms(rows), rows.shape[2], numerics.FLOAT32_ROUNDOFF)
    norms.add(torch.stack([squared, squared + bound, torch.zeros_like(squared), torch.zeros_like(squared)]))

    def add(factors: torch.Tensor, sanitize: bool) -> None:
        scaled = _cleared(rows.double() * factors.double().view(-1, 1, 1), sanitize, in_place=True)  # [B, T, D]
        total = torch.zeros(layer.weight.shape, dtype=torch.float64, device=rows.device)
        total.index_add_(0, index.reshape(-1), scaled.reshape(-1, rows.shape[2]))  # [num_embeddings, D]
        add_rows([layer.weight], total.view(1, -1).float())

    return [(rows.numel(), add)]
