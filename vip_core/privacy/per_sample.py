"""Per-sample gradient rules: for each kind of layer, per-sample squared norms and the clipped sum.

The engine (:mod:`vip_core.privacy.engine`) runs one forward and one backward that computes activation
gradients only. For every call of a supported layer it hands the layer's rule the layer input ``A`` and the
gradient ``G`` of the layer output. A rule then answers two questions for its microbatch of ``B`` samples:

* ``squared_norms()``: ``[B]``, each sample's squared gradient norm over the rule's parameters;
* ``add_clipped_sum(factors, sums)``: adds ``Σᵢ factorᵢ · gᵢ`` to the running sum of each parameter.

Linear and Conv2d weights choose per layer, by book-keeping (Bu et al., 2023), the cheaper of two ways:
*materialise* the per-sample gradients ``Gᵢᵀ Aᵢ`` (``B·T·d_in·d_out`` flops, ``B·d_in·d_out`` memory, and
the clipped sum is then a weighted sum) or keep ``A`` and ``G`` and compute the *ghost norm*
``Σ (Aᵢ Aᵢᵀ) ⊙ (Gᵢ Gᵢᵀ)`` (``B·T²·(d_in+d_out)`` flops) followed by one weighted matmul for the clipped sum.
Materialising costs no more flops and no more memory exactly when ``d_in·d_out <= T·(d_in+d_out)``; the
ghost norm is cheaper than materialising exactly when that fails, so one test decides both.
Biases, LayerNorm affine parameters and plain parameters are always materialised (they are small).

With ``tensor_cores`` (``privacy.tensor_core_sums``, off by default) a ghost clipped sum of bfloat16 tensors on CUDA
runs on tensor cores (:func:`splits_on_tensor_cores`): the same exact products, accumulated in float32 that is
not IEEE (``docs/privacy.md``, Findings and caveats). The norms stay IEEE float32 either way.
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import Future
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Sums = dict[nn.Parameter, torch.Tensor]


def materialise_is_cheaper(tokens: int, d_in: int, d_out: int) -> bool:
    """Whether per-sample weight gradients cost no more (flops and memory) than the ghost norm."""
    return d_in * d_out <= tokens * (d_in + d_out)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the tensors are used in: their promoted dtype, float32 at least."""
    return _promoted(frozenset(tensor.dtype for tensor in tensors))


@functools.cache
def _promoted(dtypes: frozenset[torch.dtype]) -> torch.dtype:
    """``torch.promote_types`` over ``dtypes`` and float32, remembered: each call is a dispatched operation, and the
    engine asks it a few times per layer and microbatch of the same handful of dtypes."""
    return functools.reduce(torch.promote_types, dtypes, torch.float32)


def add_to_sum(sums: Sums, param: nn.Parameter, value: torch.Tensor) -> None:
    """``sums[param] += value`` (shaped like ``param``), creating the entry on first use."""
    value = value.reshape(param.shape).to(param.dtype)
    if param in sums:
        sums[param].add_(value)
    else:
        sums[param] = value


def add_product_to_sum(sums: Sums, param: nn.Parameter, left: torch.Tensor, right: torch.Tensor) -> None:
    """``sums[param] += left @ right`` (``[m, k] @ [k, n]``, shaped like ``param``): straight into the running sum
    (the noise, once settled) when it has the product's dtype, so no ``param``-sized temporary and no second pass."""
    running = sums.get(param)
    if running is not None and running.dtype == left.dtype and running.is_contiguous():
        running.view(left.shape[0], right.shape[1]).addmm_(left, right)
    else:
        add_to_sum(sums, param, torch.mm(left, right))  # [m, n]


STACKED_ELEMENTS = 1 << 24  # the most elements the grouped materialised norms and sums stack at once (64 MiB float32)


# The least Gram work (multiply-adds, ``rows · T² · (d_in + d_out)``) that a layer hands to a helper thread. A handing
# over costs the calling thread its turns at the interpreter lock while the helper dispatches a dozen operations: up
# to 0.1 ms when the calling thread is busy in Python itself. Measured here (one torch thread beside one idle core, the
# DP step against the non-private one in one process): every layer handed over made the host stand-in step of ViP-Base
# (width 48, 2 to 5 tokens) x2.82 instead of x2.29; from 2^19 none of its layers goes (x2.33), and ViP-Nano went from
# x1.119 to x1.068 (x1.086 from 2^23, which keeps its encoder's layers), the tiny preset from x1.48 to x1.43.
HELPER_MIN_GRAM_WORK = 1 << 19

PerSample = list[tuple[nn.Parameter, torch.Tensor]]  # materialised per-sample gradients with their parameters


def _same_shape_groups(per_sample: PerSample) -> list[PerSample]:
    """``per_sample`` (materialised per-sample gradients ``[B, *shape]`` with their parameters) in groups of one shape,
    dtype and device, each of at most :data:`STACKED_ELEMENTS` elements (or one tensor)."""
    groups: dict[tuple, list[PerSample]] = {}
    for param, grads in per_sample:
        chunks = groups.setdefault((tuple(grads.shape), grads.dtype, grads.device), [[]])
        if chunks[-1] and (len(chunks[-1]) + 1) * grads.numel() > STACKED_ELEMENTS:
            chunks.append([])
        chunks[-1].append((param, grads))
    return [chunk for chunks in groups.values() for chunk in chunks]


def materialised_squared_norms(per_sample: PerSample, batch_size: int, device: torch.device) -> torch.Tensor:
    """``[B]`` float32: each sample's squared norm over the materialised per-sample gradients of every rule
    (``(param, [B, *param.shape])`` pairs), one stacked reduction per shape instead of one per parameter."""
    total = torch.zeros(batch_size, device=device, dtype=torch.float32)
    for group in _same_shape_groups(per_sample):
        stacked = torch.stack([grads.reshape(batch_size, -1) for _, grads in group])  # stacked: [L, B, numel]
        total += torch.linalg.vecdot(stacked, stacked).sum(0).float().to(device)  # [B]
    return total


def add_materialised_sums(per_sample: PerSample, factors: torch.Tensor, sums: Sums) -> None:
    """``sums[param] += Σᵢ factorsᵢ · gᵢ`` for every ``(param, [B, *param.shape])`` pair, one stacked product per
    shape instead of one per parameter."""
    for group in _same_shape_groups(per_sample):
        batch = group[0][1].shape[0]
        stacked = torch.stack([grads.reshape(batch, -1) for _, grads in group])  # stacked: [L, B, numel]
        weights = factors.to(stacked.dtype).expand(len(group), 1, batch)  # weights: [L, 1, B]
        weighted = torch.bmm(weights, stacked).squeeze(1)  # weighted: [L, numel]
        for (param, _), row in zip(group, weighted):
            add_to_sum(sums, param, row)


_FLOAT32_UNIT_ROUNDOFF = 2.0**-24
_FLOAT32_SMALLEST_NORMAL = 2.0**-126  # below it float32 underflows (to zero under flush-to-zero)


def ghost_parts(acts: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ghost norms ``Σ_{t,s} (aₜ·aₛ)(gₜ·gₛ)`` of ``acts`` ``[N, T, d_in]`` and ``grads`` ``[N, T, d_out]`` (in the
    compute dtype), ``[N]`` float64 without their rounding bound, and the token norms ``[N, T]`` of each, which the
    bound is computed from (:func:`bound_from_token_norms`)."""
    if acts.shape[1] == 1:  # 1 x 1 Grams
        ghost = acts.square().sum((1, 2)).double() * grads.square().sum((1, 2)).double()  # ghost: [N]
    else:
        act_gram = torch.bmm(acts, acts.transpose(1, 2))  # act_gram: [N, T, T]
        grad_gram = torch.bmm(grads, grads.transpose(1, 2))  # grad_gram: [N, T, T]
        ghost = torch.linalg.vecdot(act_gram.flatten(1).double(), grad_gram.flatten(1).double())  # [N]
    return ghost, torch.linalg.vector_norm(acts, dim=2), torch.linalg.vector_norm(grads, dim=2)


def joined_pair(inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's kept inputs and output gradients, every call's joined along the tokens, in the compute dtype (float32
    at least; a bfloat16 tensor's float32 copy is exact)."""
    dtype = _compute_dtype(*inputs, *grads)
    return _joined(inputs, dtype), _joined(grads, dtype)


def joined_ghost_parts(inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """:func:`ghost_parts` of a layer's kept inputs and output gradients (:func:`joined_pair`)."""
    return ghost_parts(*joined_pair(inputs, grads))


def gram_error_bound(acts: torch.Tensor | None, grads: torch.Tensor, length: int) -> torch.Tensor:
    """An upper bound on the rounding error of a ghost norm ``Σ_{t,s} (aₜ·aₛ)(gₜ·gₛ)`` whose Gram entries are
    float32 (or float64) dot products of at most ``length`` terms and whose sum is float64.

    Added to the ghost norm, it makes the squared norm an upper bound on the true one even when a sample's
    token contributions cancel (where the float32 value alone can round to zero and leave the sample
    unclipped); where they do not cancel it adds about ``γ · T`` of the norm, under 2 % for a ViT-Base layer.

    The error model is float32's, for every operation, also under flush-to-zero (``torch.set_flush_denormal``):
    a result is exact within a relative ``u = 2^-24`` plus an absolute ``η = 2^-126``, and an input below ``η``
    may be read as zero. Then a Gram entry errs by at most ``γ_d Σₖ|xₜₖ xₛₖ| + E`` with ``γ_d`` Higham's
    ``d·u/(1 − d·u)`` and ``E = d · 4η · (1 + M)``, ``M`` the sample's largest entry, and the ghost norm by at
    most ``1.01 · γ_L · S² + 2 (E_a (Σ‖gₜ‖)² + E_g (Σ‖aₜ‖)²) + T² E_a E_g`` with ``S = Σₜ ‖aₜ‖‖gₜ‖``: the first
    term is relative (Cauchy-Schwarz), the others cover underflow, which can make a Gram of tiny activations
    zero while their gradients are huge. The token norms come from float32 norms (a pass over the activations,
    no float64 copy; :func:`bound_from_token_norms` takes them from there), made upper bounds by
    :func:`_norm_upper_bounds`, and ``M ≤ maxₜ ‖xₜ‖``. It bounds the
    norm only: the rounding of the clipped sum itself is the floating-point caveat of ``docs/privacy.md``.

    Args:
        acts: ``[B*g, T, d_in]``, or None for a rule whose gradient is ``Σₜ gₜ`` scattered (Embedding).
        grads: ``[B*g, T, d_out]``.
        length: the longest dot product in the Gram matrices (``d_in + d_out`` covers both factors).
    """
    act_norms = None if acts is None else torch.linalg.vector_norm(acts, dim=2)  # act_norms: [B*g, T]
    d_in = 0 if acts is None else acts.shape[2]
    return bound_from_token_norms(act_norms, d_in, torch.linalg.vector_norm(grads, dim=2), grads.shape[2], length)


def bound_from_token_norms(act_norms: torch.Tensor | None, d_in: int, grad_norms: torch.Tensor, d_out: int,
                           length: int) -> torch.Tensor:
    """:func:`gram_error_bound` of rows whose token norms were computed already (``[N, T]`` each, in the rows' own
    dtype, of ``d_in``- and ``d_out``-vectors): ``[N]`` float64, row by row, so the rows of several layers of one
    shape can be bounded in one call (:class:`GramBounds`)."""
    tokens = grad_norms.shape[1]
    grad_norms = _norm_upper_bounds(grad_norms, d_out)  # grad_norms: [N, T] float64
    grad_floor = _underflow_error(d_out, grad_norms)  # [N]
    if act_norms is None:  # one Gram, of the gradients
        return 1.01 * _gamma(length) * grad_norms.sum(1).square() + 2 * tokens**2 * grad_floor
    act_norms = _norm_upper_bounds(act_norms, d_in)  # act_norms: [N, T] float64
    act_floor = _underflow_error(d_in, act_norms)  # [N]
    relative = 1.01 * _gamma(length) * (act_norms * grad_norms).sum(1).square()
    underflow = 2 * (act_floor * grad_norms.sum(1).square() + grad_floor * act_norms.sum(1).square())
    return relative + underflow + tokens**2 * act_floor * grad_floor  # [N]


class GramBounds:
    """The rounding bounds (:func:`gram_error_bound`) of a microbatch's ghost norms, deferred and computed together
    for the layers whose kept tensors have one shape: two token norms per layer and about thirty small operations
    per shape, instead of about thirty per layer (a ViT's blocks repeat a few shapes). Each row gets exactly the
    bound :func:`gram_error_bound` gives it; :meth:`total` sums them over the layers."""

    def __init__(self) -> None:
        self.groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def add(self, act_norms: torch.Tensor, grad_norms: torch.Tensor, d_in: int, d_out: int, length: int) -> None:
        """Defers the bound of ghost norms whose token norms are ``act_norms`` and ``grad_norms`` (``[N, T]`` each, of
        ``d_in``- and ``d_out``-vectors, as :func:`ghost_parts` gives them)."""
        key = (*act_norms.shape, d_in, d_out, length, act_norms.dtype, grad_norms.dtype, act_norms.device)
        act_rows, grad_rows = self.groups.setdefault(key, ([], []))
        act_rows.append(act_norms)
        grad_rows.append(grad_norms)

    def total(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """``[B]`` float64: each sample's sum of the deferred bounds (rows ``N = B·g``, ``g`` groups per sample)."""
        total = torch.zeros(batch_size, dtype=torch.float64, device=device)
        for (rows, _, d_in, d_out, length, *_), (act_norms, grad_norms) in self.groups.items():
            bounds = bound_from_token_norms(torch.cat(act_norms), d_in, torch.cat(grad_norms), d_out, length)
            total += bounds.view(len(act_norms), rows).sum(0).view(batch_size, -1).sum(1).to(device)  # [B]
        return total


def _norm_upper_bounds(computed: torch.Tensor, width: int) -> torch.Tensor:
    """``[N, T]`` float64 upper bounds on the norms of ``width``-vectors whose norms ``computed`` (``[N, T]``) were
    taken in the vectors' own dtype: its sum of squares errs by at most ``γ_d`` relative plus ``d·η`` (squares
    below ``η`` flushed), so ``‖x‖ ≤ (‖x‖^ + √(d·η)) / (1 − γ_{d+2})`` (the square root adds one rounding)."""
    return (computed.double() + math.sqrt(width * _FLOAT32_SMALLEST_NORMAL)) / (1 - _gamma(width + 2))


def _underflow_error(width: int, norms: torch.Tensor) -> torch.Tensor:
    """``[N]``: ``E = d · 4η · (1 + M)``, the absolute error underflow adds to a Gram entry of ``d``-vectors whose
    largest entry is at most ``M ≤ maxₜ ‖xₜ‖``."""
    return width * 4 * _FLOAT32_SMALLEST_NORMAL * (1 + norms.amax(1))


def _gamma(terms: int) -> float:
    """Higham's ``γₙ = n·u / (1 − n·u)`` for float32: the relative error of a float32 sum or dot product of
    ``n`` terms (or of ``n`` roundings in sequence)."""
    if terms * _FLOAT32_UNIT_ROUNDOFF >= 0.5:
        raise ValueError(f"a float32 rounding bound over {terms} terms is too loose to be useful")
    return terms * _FLOAT32_UNIT_ROUNDOFF / (1 - terms * _FLOAT32_UNIT_ROUNDOFF)


TENSOR_CORE_DEVICES = frozenset({"cuda"})  # devices with bfloat16 x bfloat16 -> float32 matmuls
# The smallest clipping norm the tensor-core sums accept. Their bfloat16 parts are exact for entries of at least
# 2^-110; below, an entry loses under 2^-124 even where a matmul flushes subnormal bfloat16 inputs to zero (which
# can also drop an unscaled entry below 2^-126). Every entry of either operand stays below about 1.8e19 (a larger
# one overflows its sample's float32 Gram, and the sample is dropped as non-finite), so a sample's sum of T tokens
# moves by at most about T·√(d_in·d_out)·1e-18: 3e-13 at T = 200 and ViT-Base's widest layer, beside C.
TENSOR_CORE_MIN_CLIP = 1e-6


def has_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` is one of :data:`TENSOR_CORE_DEVICES`."""
    return device.type in TENSOR_CORE_DEVICES


def splits_on_tensor_cores(scaled: list[torch.Tensor], other: list[torch.Tensor]) -> bool:
    """Whether a ghost clipped sum asked to run on tensor cores can, as bfloat16 parts: on a device in
    :data:`TENSOR_CORE_DEVICES`, with the operand that is not scaled bfloat16 (so exact as it is) and the scaled one
    bfloat16 or float32 (scaled in float32, then split exactly by :func:`bfloat16_parts`)."""
    return (all(t.dtype == torch.bfloat16 for t in other)
            and all(t.dtype in (torch.bfloat16, torch.float32) for t in scaled)
            and all(has_tensor_cores(t.device) for t in scaled + other))


def _joined(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The kept ``[B*g, T, d]`` tensors of a layer's calls, in ``dtype``, joined along the tokens."""
    tensors = [t.to(dtype) for t in tensors]
    return torch.cat(tensors, dim=1) if len(tensors) > 1 else tensors[0]


def bfloat16_parts(values: torch.Tensor) -> list[torch.Tensor]:
    """Three bfloat16 tensors, largest first, whose sum is exactly ``values`` (float32) for entries of magnitude
    in [2^-110, 3.3961775e38): each part rounds (to nearest) what the parts before it left, and a float32
    significand (24 bits) is three bfloat16 ones (8 bits), so the last rest is exact. Below 2^-110 the last parts
    run out of bfloat16's subnormals (:data:`TENSOR_CORE_MIN_CLIP` says what that can cost); from 3.3961775e38 the
    first part rounds to infinity (such an entry has already made its sample's norm infinite, and the sample is
    zeroed before the sum)."""
    high = values.to(torch.bfloat16)
    rest = values - high  # exact in float32: at most 16 significant bits
    middle = rest.to(torch.bfloat16)
    low = (rest - middle).to(torch.bfloat16)  # exact: at most 8 significant bits
    return [high, middle, low]


def add_float32_product(total: torch.Tensor | None, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``total + left @ right`` in float32 from bfloat16 ``left`` [m, k] and ``right`` [k, n] (``left @ right`` when
    ``total`` is None): on CUDA one tensor-core matmul (exact products, float32 accumulation and output);
    elsewhere a float32 matmul of exact float32 copies."""
    if left.device.type == "cuda":
        if total is None:
            return torch.mm(left, right, out_dtype=torch.float32)
        return torch.addmm(total, left, right, out_dtype=torch.float32)
    product = torch.mm(left.float(), right.float())  # [m, n]
    return product if total is None else total.add_(product)


class Rule:
    """Per-sample gradient bookkeeping for the parameters of one layer over one microbatch.

    Args:
        name: the layer's qualified name, used in error messages.
        params: the trainable parameters this rule covers.
    """

    uses_output = False

    def __init__(self, name: str, params: list[nn.Parameter]) -> None:
        self.name = name
        self.params = params
        self.per_sample: dict[nn.Parameter, torch.Tensor] = {}
        self.kept: list[tuple[torch.Tensor, int]] = []  # tensors kept for the norms and the sum, with their versions

    def keep(self, *tensors: torch.Tensor) -> None:
        """Remembers the versions of tensors kept from the backward until the norms and the clipped sum use them."""
        self.kept.extend((tensor, tensor._version) for tensor in tensors)

    def check_kept(self) -> None:
        """Refuses, naming the layer, a kept tensor modified in place since it was kept: the norms and the clipped
        sum must see the values the backward gave (a write that bypasses the version counter, through ``.data``
        or another view of the storage, is not seen)."""
        if any(tensor._version != version for tensor, version in self.kept):
            raise RuntimeError(f"the input or output gradient of layer '{self.name}' was modified in place after the "
                               "backward reached the layer; per-sample norms and clipped sums need them unchanged")

    def accumulate(self, param: nn.Parameter, grads: torch.Tensor) -> None:
        """Adds materialised per-sample gradients ``[B, *param.shape]`` (several calls of a layer add up)."""
        if param in self.per_sample:
            self.per_sample[param] = self.per_sample[param] + grads
        else:
            self.per_sample[param] = grads

    def start_norms(self, submit: Callable[..., Future]) -> None:
        """Called after each :meth:`record` when helper threads may take part of the norms (``submit(function, *args)``
        runs it in full float32 on a core torch leaves idle and returns its Future); a rule with nothing worth handing
        over ignores it."""

    def squared_norms(self, batch_size: int, device: torch.device, bounds: GramBounds | None = None, *,
                      materialised: bool = True) -> torch.Tensor:
        """``[B]`` squared per-sample gradient norms over this rule's parameters (0 for an unused layer). The caller
        may take two parts for every rule at once: the ghost norms' rounding bounds, deferred to ``bounds`` when
        given (then it adds ``bounds.total()``), and, without ``materialised``, the materialised per-sample
        gradients' part (:func:`materialised_squared_norms`)."""
        if materialised:
            return materialised_squared_norms(list(self.per_sample.items()), batch_size, device)
        return torch.zeros(batch_size, device=device, dtype=torch.float32)

    def add_clipped_sum(self, factors: torch.Tensor, sums: Sums, *, tensor_cores: bool = False,
                        materialised: bool = True) -> None:
        """Adds ``Σᵢ factorsᵢ · gᵢ`` to ``sums`` for each parameter of this rule (on tensor cores where
        ``tensor_cores`` is set and the rule can: :class:`MatmulRule`); the materialised per-sample gradients' part
        only with ``materialised`` (else the caller adds it for every rule at once, :func:`add_materialised_sums`)."""
        if materialised:
            add_materialised_sums(list(self.per_sample.items()), factors, sums)

    def zero_samples(self, keep: torch.Tensor) -> None:
        """Drops the samples where ``keep`` ([B] bool) is False from every stored tensor."""
        for param, grads in self.per_sample.items():
            self.per_sample[param] = _zero_rows(grads, keep)


def _zero_rows(tensor: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    mask = keep.view(-1, *([1] * (tensor.dim() - 1)))
    return torch.where(mask, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))


class MatmulRule(Rule):
    """Linear and Conv2d: output = Σ over tokens of ``W · a_t`` (+ bias), in ``groups`` independent groups.

    ``record_tokens`` receives the layer input and output gradient laid out as ``A: [B, g, T, d_in]`` and
    ``G: [B, g, T, d_out]`` by the subclass; they are kept as ``[B·g, T, d]`` (one matrix per sample and group).
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        weight = module.weight if module.weight.requires_grad else None
        bias = module.bias if module.bias is not None and module.bias.requires_grad else None
        super().__init__(name, [p for p in (weight, bias) if p is not None])
        self.weight, self.bias = weight, bias
        self.groups = getattr(module, "groups", 1)
        self.ghost_inputs: list[torch.Tensor] = []
        self.ghost_grads: list[torch.Tensor] = []
        self.materialise: bool | None = None
        self.started: tuple[torch.Tensor, torch.Tensor, Future] | None = None  # a helper's ghost parts, and of what

    def record_tokens(self, acts: torch.Tensor, grads: torch.Tensor) -> None:
        """acts: [B, g, T, d_in]; grads: [B, g, T, d_out]. Kept for the ghost norm in their own dtype (bfloat16
        under autocast: half the memory of a float32 copy, and often the very tensor autograd saved) and cast to
        float32 (exactly) where they are used, so the norms and sums see the same values either way."""
        dtype = _compute_dtype(acts, grads)
        batch, groups, tokens = acts.shape[:3]
        acts = acts.reshape(batch * groups, tokens, acts.shape[3])  # acts: [B*g, T, d_in]
        grads = grads.reshape(batch * groups, tokens, grads.shape[3])  # grads: [B*g, T, d_out]
        if self.bias is not None:
            self.accumulate(self.bias, grads.to(dtype).sum(1).reshape(batch, *self.bias.shape))  # [B, g*d_out]
        if self.weight is None:
            return
        if self.materialise is None:
            self.materialise = materialise_is_cheaper(tokens, acts.shape[2], grads.shape[2])
        if self.materialise:
            per_sample = torch.bmm(grads.to(dtype).transpose(1, 2), acts.to(dtype))  # [B*g, d_out, d_in]
            self.accumulate(self.weight, per_sample.reshape(batch, *self.weight.shape))
        else:
            self.ghost_inputs.append(acts)
            self.ghost_grads.append(grads)
            self.keep(acts, grads)

    def start_norms(self, submit: Callable[..., Future]) -> None:
        """Hands the ghost parts (:func:`ghost_parts`: the Gram matrices, and the token norms of the rounding bound) of
        the layer's one call so far to a helper, for :meth:`squared_norms` to take instead of computing them, when
        its Gram matrices are worth a hand-off (:data:`HELPER_MIN_GRAM_WORK`). A second call drops them (the Gram
        matrices span every call's tokens). CPU tensors only: a device runs its kernels on its own queue, and a
        helper thread would only add launches."""
        if self.started is not None:  # a second call: the first call's Gram matrices alone are of no use
            self.started[2].cancel()
        self.started = None
        if len(self.ghost_inputs) == 1 and self.ghost_inputs[0].device.type == "cpu":
            acts, grads = self.ghost_inputs[0], self.ghost_grads[0]
            rows, tokens = acts.shape[:2]
            if rows * tokens**2 * (acts.shape[2] + grads.shape[2]) >= HELPER_MIN_GRAM_WORK:
                self.started = (acts, grads, submit(joined_ghost_parts, [acts], [grads]))

    def _ghost_parts(self) -> tuple[torch.Tensor, ...]:
        """:func:`joined_ghost_parts` of the kept tensors: the helper's, when it was handed exactly these, else computed
        here."""
        if self.started is not None:
            acts, grads, parts = self.started
            if len(self.ghost_inputs) == 1 and self.ghost_inputs[0] is acts and self.ghost_grads[0] is grads:
                return parts.result()
        return joined_ghost_parts(self.ghost_inputs, self.ghost_grads)

    def squared_norms(self, batch_size: int, device: torch.device, bounds: GramBounds | None = None, *,
                      materialised: bool = True) -> torch.Tensor:
        total = super().squared_norms(batch_size, device, bounds, materialised=materialised)
        if self.ghost_inputs:
            ghost, act_norms, grad_norms = self._ghost_parts()  # [B*g], [B*g, T], [B*g, T]
            d_in, d_out = self.ghost_inputs[0].shape[2], self.ghost_grads[0].shape[2]
            if bounds is None:
                ghost = ghost + bound_from_token_norms(act_norms, d_in, grad_norms, d_out, d_in + d_out)
            else:
                bounds.add(act_norms, grad_norms, d_in, d_out, d_in + d_out)
            total += ghost.view(batch_size, -1).sum(1).float()
        return total

    def add_clipped_sum(self, factors: torch.Tensor, sums: Sums, *, tensor_cores: bool = False,
                        materialised: bool = True) -> None:
        super().add_clipped_sum(factors, sums, materialised=materialised)
        if not self.ghost_inputs:
            return
        if tensor_cores and self.groups == 1 and self._splits():
            self._add_split_clipped_sum(factors, sums)
            return
        acts, grads = joined_pair(self.ghost_inputs, self.ghost_grads)
        groups, d_in, d_out = self.groups, acts.shape[2], grads.shape[2]
        factors = factors.to(grads.dtype)
        if groups > 1:  # a copy: skipped for the common case
            factors = factors.repeat_interleave(groups)
        factors = factors.view(-1, 1, 1)  # [B*g, 1, 1]
        if self._scales_inputs():
            acts = acts * factors
        else:
            grads = grads * factors
        if groups == 1:
            add_product_to_sum(sums, self.weight, grads.reshape(-1, d_out).t(), acts.reshape(-1, d_in))
            return
        grads = grads.view(-1, groups, grads.shape[1], d_out).transpose(0, 1).reshape(groups, -1, d_out)
        acts = acts.view(-1, groups, acts.shape[1], d_in).transpose(0, 1).reshape(groups, -1, d_in)
        add_to_sum(sums, self.weight, torch.bmm(grads.transpose(1, 2), acts))  # [g, d_out, d_in]

    def _scales_inputs(self) -> bool:
        """Whether the clipped sum scales the inputs (the smaller operand) rather than the output gradients."""
        return self.ghost_inputs[0].shape[-1] <= self.ghost_grads[0].shape[-1]

    def _scaled_and_other(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The kept tensors of the operand the clipped sum scales, and of the other one."""
        if self._scales_inputs():
            return self.ghost_inputs, self.ghost_grads
        return self.ghost_grads, self.ghost_inputs

    def _splits(self) -> bool:
        """Whether the clipped sum runs on tensor cores (:func:`splits_on_tensor_cores`)."""
        return splits_on_tensor_cores(*self._scaled_and_other())

    def _add_split_clipped_sum(self, factors: torch.Tensor, sums: Sums) -> None:
        """The weight's clipped sum on tensor cores: the scaled operand (float32, the very values the float32 path
        multiplies) as three bfloat16 parts that add up to it exactly, each part's product with the other operand
        (bfloat16, exact) summed in float32."""
        scaled_kept, other_kept = self._scaled_and_other()
        scaled = _joined(scaled_kept, torch.float32) * factors.float().view(-1, 1, 1)  # [B, T, d_scaled]
        scaled = scaled.reshape(-1, scaled.shape[2])  # [B*T, d_scaled]
        other = _joined(other_kept, torch.bfloat16)
        other = other.reshape(-1, other.shape[2])  # [B*T, d_other]
        total = None
        for part in reversed(bfloat16_parts(scaled)):  # the smallest part first
            grads, acts = (other, part) if self._scales_inputs() else (part, other)  # [B*T, d_out], [B*T, d_in]
            total = add_float32_product(total, grads.t(), acts)  # [d_out, d_in]
        add_to_sum(sums, self.weight, total)

    def zero_samples(self, keep: torch.Tensor) -> None:
        super().zero_samples(keep)
        keep = keep.repeat_interleave(self.groups)
        self.started = None
        self.ghost_inputs = [_zero_rows(a, keep) for a in self.ghost_inputs]
        self.ghost_grads = [_zero_rows(g, keep) for g in self.ghost_grads]
        self.kept = []
        self.keep(*self.ghost_inputs, *self.ghost_grads)


class LinearRule(MatmulRule):
    """``nn.Linear`` on inputs ``[B, ..., d_in]``: every middle position is a token."""

    def record(self, inputs: torch.Tensor, output: torch.Tensor | None, output_grad: torch.Tensor) -> None:
        batch = inputs.shape[0]
        acts = inputs.reshape(batch, 1, -1, inputs.shape[-1])  # acts: [B, 1, T, d_in]
        grads = output_grad.reshape(batch, 1, -1, output_grad.shape[-1])  # grads: [B, 1, T, d_out]
        self.record_tokens(acts, grads)


class Conv2dRule(MatmulRule):
    """``nn.Conv2d`` (any stride, padding mode, dilation, groups): every output position is a token of the
    unfolded input."""

    def __init__(self, name: str, module: nn.Conv2d) -> None:
        super().__init__(name, module)
        self.module = module

    def record(self, inputs: torch.Tensor, output: torch.Tensor | None, output_grad: torch.Tensor) -> None:
        conv = self.module
        batch, groups = inputs.shape[0], conv.groups
        grads = output_grad.reshape(batch, groups, output_grad.shape[1] // groups, -1).transpose(2, 3)  # [B, g, T, d_out]
        if _cuts_patches(conv):
            self.record_tokens(patches(inputs, conv.kernel_size).unsqueeze(1), grads)  # acts: [B, 1, T, d_in]
            return
        padding = conv._reversed_padding_repeated_twice
        if any(padding):
            mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
            inputs = F.pad(inputs, padding, mode=mode)
        unfolded = F.unfold(inputs, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)  # [B, C*k*k, T]
        acts = unfolded.view(batch, groups, -1, unfolded.shape[-1]).transpose(2, 3)  # acts: [B, g, T, d_in]
        self.record_tokens(acts, grads)


def _cuts_patches(conv: nn.Conv2d) -> bool:
    """Whether ``conv`` reads non-overlapping patches (a ViT's patch embedding): one group, no padding, no dilation,
    stride equal to the kernel."""
    return (conv.groups == 1 and not any(conv._reversed_padding_repeated_twice) and tuple(conv.dilation) == (1, 1)
            and tuple(conv.stride) == tuple(conv.kernel_size))


def patches(inputs: torch.Tensor, kernel_size: tuple[int, int]) -> torch.Tensor:
    """``F.unfold(inputs, kernel_size, stride=kernel_size)`` laid out token-first, ``[B, T, C·kh·kw]``, by one copy
    (``im2col`` is a slow kernel on CUDA): the same values in the same order, and like F.unfold's a copy even where
    a view would do (a 1 x 1 kernel, a kernel the size of the image), so that the rule keeps what the layer read."""
    batch, channels, height, width = inputs.shape
    (kh, kw), rows, cols = kernel_size, height // kernel_size[0], width // kernel_size[1]
    cut = inputs[:, :, :rows * kh, :cols * kw].reshape(batch, channels, rows, kh, cols, kw)
    tokens = cut.permute(0, 2, 4, 1, 3, 5).reshape(batch, rows * cols, channels * kh * kw)  # [B, T, C*kh*kw]
    return tokens.clone() if tokens.untyped_storage().data_ptr() == inputs.untyped_storage().data_ptr() else tokens


class LayerNormRule(Rule):
    """``nn.LayerNorm``: weight gradient ``Σ_t G ⊙ x̂``, bias gradient ``Σ_t G``, per sample.

    ``x̂`` is not recomputed: with ``y = x̂ ⊙ w + b`` the layer's output, ``Σ_t G ⊙ x̂ = (Σ_t G ⊙ y − b ⊙ Σ_t G) / w``,
    used when no |w| is below |b| / 100 (so rounding stays near float precision); otherwise the input
    is normalised again. Either way the norm is taken of the very tensor that is summed, so clipping
    bounds the sensitivity exactly.
    """

    uses_output = True

    def __init__(self, name: str, module: nn.LayerNorm) -> None:
        weight = module.weight if module.weight is not None and module.weight.requires_grad else None
        bias = module.bias if module.bias is not None and module.bias.requires_grad else None
        super().__init__(name, [p for p in (weight, bias) if p is not None])
        self.module, self.weight, self.bias = module, weight, bias
        # decided on first read of :attr:`invertible`, or for many rules at once by :func:`decide_conditioning`
        self._invertible: bool | None = None if weight is not None else False

    @property
    def invertible(self) -> bool:
        """Whether the weight gradient divides by the weight (see the class) rather than normalising again."""
        if self._invertible is None:
            decide_conditioning([self])
        return self._invertible

    def record(self, inputs: torch.Tensor, output: torch.Tensor | None, output_grad: torch.Tensor) -> None:
        shape = self.module.normalized_shape
        batch = inputs.shape[0]
        grads = output_grad.float().reshape(batch, -1, *shape)  # grads: [B, T, *shape]
        grad_sum = grads.sum(1)  # grad_sum: [B, *shape], the bias gradient
        if self.weight is not None:
            self.accumulate(self.weight, self._weight_grads(inputs, output, grads, grad_sum))
        if self.bias is not None:
            self.accumulate(self.bias, grad_sum)

    def _weight_grads(
        self, inputs: torch.Tensor, output: torch.Tensor | None, grads: torch.Tensor, grad_sum: torch.Tensor
    ) -> torch.Tensor:
        """Σ_t G ⊙ x̂: [B, *shape]."""
        if output is not None and self.invertible:
            weighted = (grads * output.float().reshape_as(grads)).sum(1)  # Σ_t G ⊙ y: [B, *shape]
            if self.module.bias is not None:
                weighted = weighted - self.module.bias.detach().float() * grad_sum
            return weighted / self.weight.detach().float()
        normalized = F.layer_norm(inputs.float(), self.module.normalized_shape, eps=self.module.eps)  # x̂
        return (grads * normalized.reshape_as(grads)).sum(1)


def _well_conditioned(weights: torch.Tensor, biases: torch.Tensor | None) -> torch.Tensor:
    """``[k]`` bool: for each row of ``weights`` ``[k, *shape]``, whether dividing by it after subtracting its row of
    ``biases`` keeps the rounding near float precision. Decided in float32, the dtype the weight gradient divides in:
    a float64 weight below float32's smallest normal number would divide by zero (or a flushed denormal) there."""
    weights = weights.float()
    scale = biases.float().abs() / 100 if biases is not None else torch.zeros_like(weights)
    magnitudes = weights.abs()
    return ((magnitudes > scale) & (magnitudes >= _FLOAT32_SMALLEST_NORMAL)).flatten(1).all(1)


def decide_conditioning(rules: list[Rule]) -> None:
    """Decides :attr:`LayerNormRule.invertible` of every LayerNorm rule in ``rules`` together: one computation per
    weight shape, dtype and device over the stacked weights and biases, and one transfer per device, instead of
    several operations and a read per layer (each read a device sync on a GPU: a ViT has two dozen LayerNorms)."""
    groups: dict[tuple, list[LayerNormRule]] = {}
    for rule in rules:
        if isinstance(rule, LayerNormRule) and rule._invertible is None:
            weight, bias = rule.weight, rule.module.bias
            key = (weight.shape, weight.dtype, weight.device, None if bias is None else (bias.shape, bias.dtype))
            groups.setdefault(key, []).append(rule)
    decided: dict[torch.device, list[tuple[list[LayerNormRule], torch.Tensor]]] = {}
    for (_, _, device, has_bias), group in groups.items():
        weights = torch.stack([rule.weight.detach() for rule in group])  # weights: [k, *shape]
        biases = None if has_bias is None else torch.stack([rule.module.bias.detach() for rule in group])
        decided.setdefault(device, []).append((group, _well_conditioned(weights, biases)))
    for pairs in decided.values():
        flags = torch.cat([flags for _, flags in pairs]).tolist()  # one transfer per device
        for rule, flag in zip([rule for group, _ in pairs for rule in group], flags):
            rule._invertible = flag


class EmbeddingRule(Rule):
    """``nn.Embedding``: the per-sample gradient scatters ``G`` rows to the looked-up indices; its norm is
    ``Σ_{t,s} [idx_t = idx_s] G_t·G_s`` and the clipped sum is one ``index_add``."""

    def __init__(self, name: str, module: nn.Embedding) -> None:
        super().__init__(name, [module.weight])
        self.module = module
        self.weight = module.weight
        self.indices: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []

    def record(self, indices: torch.Tensor, output: torch.Tensor | None, output_grad: torch.Tensor) -> None:
        batch = indices.shape[0]
        indices = indices.reshape(batch, -1)  # indices: [B, T]
        grads = output_grad.float().reshape(batch, -1, output_grad.shape[-1])  # grads: [B, T, D]
        if self.module.padding_idx is not None:
            grads = grads * (indices != self.module.padding_idx).unsqueeze(-1)
        self.indices.append(indices)
        self.grads.append(grads)
        self.keep(indices, grads)

    def squared_norms(self, batch_size: int, device: torch.device, bounds: GramBounds | None = None, *,
                      materialised: bool = True) -> torch.Tensor:
        total = super().squared_norms(batch_size, device, bounds, materialised=materialised)
        if self.grads:
            indices, grads = torch.cat(self.indices, 1), torch.cat(self.grads, 1)
            same = indices.unsqueeze(2) == indices.unsqueeze(1)  # same: [B, T, T]
            gram = torch.bmm(grads, grads.transpose(1, 2))  # gram: [B, T, T]
            squared = (gram.double() * same).sum((1, 2))  # [B]
            total += (squared + gram_error_bound(None, grads, grads.shape[2])).float()
        return total

    def add_clipped_sum(self, factors: torch.Tensor, sums: Sums, *, tensor_cores: bool = False,
                        materialised: bool = True) -> None:
        """In float64, whatever ``tensor_cores`` says: a sample's many tokens on one row, summed in float32, could
        lose more than its norm's rounding bound allows (each small term swallowed by a large partial sum that later
        cancels)."""
        for indices, grads in zip(self.indices, self.grads):
            scaled = grads.double() * factors.double().view(-1, 1, 1)  # scaled: [B, T, D]
            rows = torch.zeros(self.weight.shape, dtype=torch.float64, device=grads.device)
            rows.index_add_(0, indices.reshape(-1), scaled.reshape(-1, grads.shape[-1]))
            add_to_sum(sums, self.weight, rows)

    def zero_samples(self, keep: torch.Tensor) -> None:
        self.grads = [_zero_rows(g, keep) for g in self.grads]
        self.kept = []
        self.keep(*self.indices, *self.grads)


class PlainRule(Rule):
    """A plain parameter of shape ``[1, ...]`` broadcast against the batch (class, mask and position
    tokens). The forward sees a per-sample stand-in ``[B, ...]``, whose gradient is the per-sample gradient."""

    def __init__(self, name: str, param: nn.Parameter) -> None:
        super().__init__(name, [param])
        self.param = param

    def record_stand_in(self, grads: torch.Tensor | None) -> None:
        """grads: [B, *param.shape[1:]], or None when the parameter did not reach the loss."""
        if grads is not None:
            self.accumulate(self.param, grads.unsqueeze(1).float())  # [B, 1, ...]


RULES: dict[type[nn.Module], Callable[[str, nn.Module], Rule]] = {
    nn.Linear: LinearRule,
    nn.Conv2d: Conv2dRule,
    nn.LayerNorm: LayerNormRule,
    nn.Embedding: EmbeddingRule,
}
