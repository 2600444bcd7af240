"""The error model of the per-sample norms and clipped sums (``docs/privacy.md``, rule 12).

Each sample's contribution to the clipped sum must have norm at most C. A layer's contribution is computed from
two operands, its kept inputs ``A`` and output gradients ``G`` (bfloat16 under autocast, exactly the values the
layer multiplied): one of them, ``X`` (the narrower), is scaled by the sample's clip factor ``f`` and rounded to
the operand dtype, and what is summed for the sample is ``Σₜ x̂ₜ oₜᵀ`` with ``x̂ₜ = round(f·xₜ)``. The engine's clip
factor is

    f = min(1, (C − Z) / (U + M))

with ``U`` an upper bound on the norm of the sample's gradient over every parameter (the ghost norms plus the
bound on their Gram matrices' rounding, and the materialised per-sample gradients' squares), ``M`` a bound on the
norm of the scaled operands' rounding divided by ``f``, and ``Z`` a bound on what numbers flushed to zero below
float32's normal range can add (:func:`ghost_terms` gives all three for the ghost norms). Then the summed
contribution has norm at most ``f·U + f·M + Z ≤ C``.

Matmuls multiply exactly (a bfloat16 product fits a float32 significand, whether on a GPU's matrix units or as
float32 copies) and accumulate with a unit roundoff ``u``: ``2^-24`` for IEEE float32, and a stated ``2^-21`` on
CUDA tensor cores, whose float32 accumulation truncates (:func:`probe_matrix_units` checks a device once and the
engine falls back to IEEE float32 where it fails). Token norms are float32 reductions (``2^-24``) made upper
bounds. Rounding in the sum across samples is not attributed to any sample (the floating-point caveat of
``docs/privacy.md``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch

FLOAT32_ROUNDOFF = 2.0**-24
BFLOAT16_ROUNDOFF = 2.0**-8
TENSOR_CORE_ROUNDOFF = 2.0**-21  # stated for tensor cores' float32 accumulation; checked by the probe
SMALLEST_NORMAL = 2.0**-126  # below it a float32 or bfloat16 number may be flushed to zero
FACTOR_ROUNDING = 1 - 2.0**-23  # a float64 clip factor times this rounds to a float32 no larger than it


MAX_SQUARED_TERMS = 1 << 30  # squares_bound's reach: (1 + 2^-24)(1 + γ_n at 2^-53) <= 1 + 2^-22 for n <= 1.6e9


def gamma(terms: int, unit_roundoff: float) -> float:
    """Higham's ``γₙ = n·u / (1 − n·u)``: the relative error of a sum or dot product of ``n`` terms."""
    if terms * unit_roundoff >= 0.5:
        raise ValueError(f"a rounding bound over {terms} terms at unit roundoff {unit_roundoff:g} is too loose")
    return terms * unit_roundoff / (1 - terms * unit_roundoff)


@dataclass(frozen=True)
class Numerics:
    """How a device's norms and clipped sums compute.

    Attributes:
        strict: IEEE float32 throughout (``privacy.strict_float32``): bfloat16 operands are copied to float32
            and the scaled operand stays float32.
        tensor_cores: bfloat16 operands multiplied on the device's matrix units with float32 output (CUDA).
        accumulation: the unit roundoff of the matmuls' float32 accumulation.
    """

    strict: bool
    tensor_cores: bool
    accumulation: float

    def operand_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype an operand kept in ``dtype`` is multiplied in (bfloat16 stays bfloat16 unless strict)."""
        return torch.bfloat16 if dtype == torch.bfloat16 and not self.strict else torch.float32

    def operand(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in the dtype it is multiplied in (itself where it is in it already)."""
        dtype = self.operand_dtype(tensor.dtype)
        return tensor if tensor.dtype == dtype else tensor.to(dtype)

    def scaled_roundoff(self, dtype: torch.dtype) -> float:
        """The relative error of ``round(f·x)`` for an operand multiplied in ``dtype``: the float32 product's
        rounding, then bfloat16's where it is rounded again."""
        if self.operand_dtype(dtype) == torch.bfloat16:
            return BFLOAT16_ROUNDOFF + 2 * FLOAT32_ROUNDOFF
        return FLOAT32_ROUNDOFF

    def bmm(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        """``left @ right`` (``[n, m, k] @ [n, k, p]``) with float32 output: bfloat16 operands on tensor cores,
        anything else as float32 copies (exact) under IEEE float32 matmuls."""
        if self.tensor_cores and left.dtype == right.dtype == torch.bfloat16:
            return torch.bmm(left, right, out_dtype=torch.float32)
        return torch.bmm(left.float(), right.float())


IEEE = Numerics(strict=True, tensor_cores=False, accumulation=FLOAT32_ROUNDOFF)
CPU_MIXED = Numerics(strict=False, tensor_cores=False, accumulation=FLOAT32_ROUNDOFF)
TENSOR_CORES = Numerics(strict=False, tensor_cores=True, accumulation=TENSOR_CORE_ROUNDOFF)


def numerics_for(device: torch.device, *, strict: bool) -> Numerics:
    """The numerics of ``device``: IEEE float32 when ``strict``; on CUDA tensor cores once the device passed
    :func:`probe_matrix_units` (IEEE float32 with a warning otherwise); elsewhere bfloat16 operands as exact
    float32 copies."""
    if strict:
        return IEEE
    if device.type != "cuda":
        return CPU_MIXED
    failure = _probe_once(str(device))
    if failure is None:
        return TENSOR_CORES
    warnings.warn(f"{device}: the tensor cores' accumulation is worse than the stated unit roundoff 2^-21 "
                  f"({failure}); per-sample norms and clipped sums run in IEEE float32 instead", stacklevel=3)
    return IEEE


@functools.cache
def _probe_once(device: str) -> str | None:
    return probe_matrix_units(TENSOR_CORES.bmm, torch.device(device), TENSOR_CORE_ROUNDOFF)


# Small terms beside a product of 1, of sizes an accumulator keeping the stated precision adds within its bound and
# a coarser one (one that drops them, or truncates them to a coarser grid) misses by more than the bound allows.
_PROBE_SMALL = ((3 * 2.0**-11, 2.0**-11), (2.0**-10, 2.0**-10), (2.0**-9, 2.0**-8))  # 3·2^-22, 2^-20, 2^-17
_PROBE_LENGTHS = (2, 3, 8, 17, 64, 257, 1024)
_PROBE_SCALES = (2.0**-60, 1.0, 2.0**60)
# The shapes the probe multiplies its dot products in, as (rows of each matrix, matrices in the product; None: as
# many as the dot products, at least 2): a library picks its kernel by shape, batch count included (torch calls a
# plain GEMM for a batch of one). One dot product alone and batched dot products (the Grams of one token per
# sample); one product of 128-row matrices and a batch of 64 (the Grams of many tokens).
_PROBE_SHAPES = ((1, 1), (1, None), (128, 1), (128, 64))


def probe_matrix_units(bmm: Any, device: torch.device, unit_roundoff: float) -> str | None:
    """Checks a matmul's accumulation against ``unit_roundoff`` on dot products of bfloat16 vectors whose exact
    values are known: a product of 1 with many small products of either sign, at the start, middle or end of the
    reduction and at three scales, and random vectors of mixed magnitudes. Each length's dot products are multiplied
    in every shape of ``_PROBE_SHAPES`` (:func:`_probe_products`). Returns None when every result lies within
    ``γ_K(u)·Σ|products|`` of the exact value (the products are exact, and their float64 sum errs far below that),
    else what failed."""
    cases = [_probe_vectors(length, small, sign, where, scale)
             for length in _PROBE_LENGTHS for small in _PROBE_SMALL for sign in (1.0, -1.0)
             for where in ("start", "middle", "end") for scale in _PROBE_SCALES]
    generator = torch.Generator().manual_seed(0)
    for length in (16, 1000, 4096):
        magnitudes = torch.exp2(torch.randint(-30, 30, (length,), generator=generator).double())
        cases.append((torch.randn(length, generator=generator, dtype=torch.float64) * magnitudes,
                      torch.randn(length, generator=generator, dtype=torch.float64)))
    by_length: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for left, right in cases:
        by_length.setdefault(len(left), []).append((left, right))
    for pairs in by_length.values():
        for rows, matrices in _PROBE_SHAPES:
            batch = matrices or max(2, len(pairs))
            for start in range(0, len(pairs), rows * batch):
                failure = _probe_products(bmm, device, unit_roundoff, pairs[start:start + rows * batch], rows, batch)
                if failure is not None:
                    return failure
    return None


def _probe_products(bmm: Any, device: torch.device, unit_roundoff: float,
                    pairs: list[tuple[torch.Tensor, torch.Tensor]], rows: int, matrices: int) -> str | None:
    """:func:`probe_matrix_units` on up to ``rows · matrices`` ``pairs`` of float64 vectors of one length ``K``,
    multiplied as one batch of ``matrices`` ``[rows, K] @ [K, rows]`` products: pair ``c``'s vectors, rounded to
    bfloat16, are row ``r = c // matrices`` of left matrix ``c % matrices`` and column ``r`` of the right one (every
    other entry 0), so that their dot product is entry ``(r, r)`` of that product."""
    left = torch.stack([pair[0] for pair in pairs]).bfloat16()  # [c, K]: the values the device multiplies
    right = torch.stack([pair[1] for pair in pairs]).bfloat16()  # [c, K]
    count, length = left.shape
    matrix, row = torch.arange(count) % matrices, torch.arange(count) // matrices  # where each pair goes: [c] each
    lefts, rights = (torch.zeros(matrices, rows, length, dtype=torch.bfloat16) for _ in range(2))
    lefts[matrix, row], rights[matrix, row] = left, right
    try:
        got = bmm(lefts.to(device), rights.to(device).transpose(1, 2))  # [m, rows, rows]
    except RuntimeError as error:
        return f"its bfloat16 matmul with float32 output failed: {error}"
    computed = got.cpu()[matrix, row, row].double()  # [c]
    products = left.double() * right.double()  # [c, K]: exact
    error = (computed - products.sum(1)).abs()
    allowed = gamma(length, unit_roundoff) * products.abs().sum(1)
    failed = (~(error <= allowed)).nonzero()  # a NaN result fails too
    if len(failed) == 0:
        return None
    first = int(failed[0])
    return (f"a dot product of {length} terms erred by {float(error[first]):.3g} where the bound allows "
            f"{float(allowed[first]):.3g} (in a batch of {matrices} [{rows}, {length}] @ [{length}, {rows}] "
            "products)")


def _probe_vectors(length: int, small: tuple[float, float], sign: float, where: str,
                   scale: float) -> tuple[torch.Tensor, ...]:
    """Two float64 vectors of bfloat16 values whose products are ``scale`` at one position and ``sign·l·r·scale``
    at the others (``small = (l, r)``)."""
    left = torch.full((length,), small[0], dtype=torch.float64)
    right = torch.full((length,), sign * small[1], dtype=torch.float64)
    big = {"start": 0, "middle": length // 2, "end": length - 1}[where]
    left[big], right[big] = 1.0, 1.0
    return left * scale, right


# ------------------------------------------------------------------------------------------------ the bounds


def norm_upper_bounds(computed: torch.Tensor, width: int) -> torch.Tensor:
    """float64 upper bounds on the norms of ``width``-vectors whose norms ``computed`` are float32 reductions: the
    sum of squares errs by at most ``γ_d`` relative plus ``d·η`` (squares flushed below ``η``), and the square root
    adds one rounding, so ``‖x‖ ≤ (‖x‖^ + √(d·η)) / (1 − γ_{d+2})``."""
    return (computed.double() + math.sqrt(width * SMALLEST_NORMAL)) / (1 - gamma(width + 2, FLOAT32_ROUNDOFF))


def ghost_terms(act_gram: torch.Tensor, grad_gram: torch.Tensor, computed_norms: torch.Tensor, d_in: int,
                d_out: int, numbers: "Numerics", dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[torch.Tensor, ...]:
    """The ghost norms of ``N`` rows and their error terms, and which operand each row's clipped sum scales.

    Args:
        act_gram: ``[N, T, T]`` float32, the computed Grams ``K̂ᴬ`` of the activations (``d_in``-vectors).
        grad_gram: ``[N, T, T]`` float32, the computed Grams ``K̂ᴳ`` of the output gradients (``d_out``-vectors).
        computed_norms: ``[2, N, T]`` float32 reductions of the activations' and the gradients' token norms.
        numbers: the device's numerics (the matmuls' unit roundoff ``u``).
        dtypes: the dtypes the activations and the gradients are multiplied in (the scaled operand's rounding).

    Returns:
        ``[4, N]`` float64: the computed ghost norm ``Σ K̂ᴬ⊙K̂ᴳ``; it plus its error bound; the rounding margin ``M²``
        of the row's scaled operand; and ``Z`` (the rows of a :class:`~vip_core.privacy.per_sample.Norms`). And
        which operand each row scales: ``[N]`` bool, True where the activations are; or one bool for every row,
        where both operands round as float32 (the narrower one).

    With ``n`` the token norms' upper bounds, a Gram entry errs by at most ``γ·‖xₜ‖‖xₛ‖ + E`` (``E = d·4η·(1 + Σ‖xₜ‖)``
    covers flushed underflow), so the ghost norm errs by at most ``γ_a·Q_G + γ_g·Q_A + 3γ_aγ_g·S² + 2(E_a s_g² +
    E_g s_a²) + T²E_aE_g``, plus the float32 products' and the float64 sum's rounding, ``(2^-23 + T²·2^-52)`` times
    ``Σ|K̂ᴬ⊙K̂ᴳ| ≤ (1 + γ_a)·Q_G + E_a s_g²``, where ``Q_G = n_aᵀ|K̂ᴳ|n_a``, ``Q_A = n_gᵀ|K̂ᴬ|n_g`` (float32 sums of
    non-negative terms, made upper bounds by ``1 + 2γ_{T+1}``), ``S = Σₜ ‖aₜ‖‖gₜ‖`` and ``s = Σₜ ‖xₜ‖`` (the underflow
    terms are bounded through ``P = (1 + s_a)(1 + s_g)``). Rounding the scaled activations, ``round(f·aₜ) = f·aₜ +
    δₜ`` with ``‖δₜ‖ ≤ f·u_a·‖aₜ‖``, adds ``Σₜ gₜδₜᵀ``, whose squared norm ``Σ_{t,s} (gₜ·gₛ)(δₜ·δₛ)`` is at most
    ``f²·u_a²·(Q_G + γ_g S² + E_g s_a²)``; likewise for the gradients. Each row scales the operand whose margin is
    the smaller (a choice that depends on that sample alone).
    """
    tokens = act_gram.shape[1]
    offsets, scales = _norm_bound_constants(d_in, d_out, act_gram.device)  # [2, 1, 1] float64 each
    norms = (computed_norms.double() + offsets) * scales  # norms: [2, N, T] float64 (norm_upper_bounds)
    ghost = torch.sum(act_gram * grad_gram, (1, 2), dtype=torch.float64)  # [N]
    quadratic = _quadratics(torch.stack([grad_gram, act_gram]), norms.float())  # (Q_G, Q_A) rounded: [2, N]
    quadratic = quadratic.double() * (1 + 2 * gamma(tokens + 1, FLOAT32_ROUNDOFF))  # (Q_G, Q_A): [2, N]
    cross = norms.prod(0).sum(1)  # S: [N]
    growth = (norms.sum(2) + 1).prod(0)  # P: [N]
    features = torch.cat([quadratic, torch.stack([cross, growth]).square()])  # (Q_G, Q_A, S², P²): [4, N]
    bound, margin_acts, margin_grads = _ghost_weights(d_in, d_out, tokens, numbers, *dtypes,
                                                      act_gram.device) @ features  # [3, N]
    underflow = (1.01 * SMALLEST_NORMAL * (math.sqrt(d_in) + math.sqrt(d_out))) * growth
    if max(numbers.scaled_roundoff(dtype) for dtype in dtypes) == FLOAT32_ROUNDOFF:
        scales_acts = d_in <= d_out  # float32 rounding: a margin of 2^-24 either way, so the narrower one is scaled
        margin = margin_acts if scales_acts else margin_grads
    else:
        scales_acts = margin_acts <= margin_grads
        margin = torch.minimum(margin_acts, margin_grads)
    return torch.stack([ghost, ghost + bound, margin, underflow]), scales_acts


def _quadratics(grams: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """``[2, N]`` float32: ``nᵀ|K|n`` for each of the stacked ``grams`` ``[2, N, T, T]`` (taken in place) with its
    ``norms`` ``[2, N, T]`` (rounded to nearest: the caller makes them upper bounds)."""
    pairs, rows, tokens = norms.shape
    weighted = torch.bmm(grams.abs_().view(-1, tokens, tokens), norms.view(-1, tokens, 1))  # [2N, T, 1]
    return torch.linalg.vecdot(weighted.view(pairs, rows, tokens), norms)


@functools.cache
def _norm_bound_constants(d_in: int, d_out: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`norm_upper_bounds`' offset ``√(d·η)`` and scale ``1/(1 − γ_{d+2})`` for ``d_in`` and ``d_out``."""
    offsets = [math.sqrt(width * SMALLEST_NORMAL) for width in (d_in, d_out)]
    scales = [1 / (1 - gamma(width + 2, FLOAT32_ROUNDOFF)) for width in (d_in, d_out)]
    return tuple(torch.tensor(values, dtype=torch.float64, device=device).view(2, 1, 1) for values in (offsets, scales))


@functools.cache
def _ghost_weights(d_in: int, d_out: int, tokens: int, numbers: "Numerics", act_dtype: torch.dtype,
                   grad_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[3, 4]`` float64: the bound, the activations' and the gradients' margins of :func:`ghost_terms` as weights of
    its features ``(Q_G, Q_A, S², P²)``; ``E_a s_g²``, ``E_g s_a²`` and ``T²E_aE_g`` are at most ``4η·d_in·P²``,
    ``4η·d_out·P²`` and ``16η²T²·d_in·d_out·P²``."""
    g_in, g_out = gamma(d_in, numbers.accumulation), gamma(d_out, numbers.accumulation)
    eta = SMALLEST_NORMAL
    products = 2.0**-23 + tokens**2 * 2.0**-52  # the products' and the float64 sum's rounding, of Σ|K̂ᴬ⊙K̂ᴳ|
    underflow = (8 + 4 * products) * eta * (d_in + d_out) + 16 * eta**2 * tokens**2 * d_in * d_out
    u_acts, u_grads = numbers.scaled_roundoff(act_dtype)**2, numbers.scaled_roundoff(grad_dtype)**2
    weights = [[g_in + products * (1 + g_in), g_out, 3 * g_in * g_out, underflow],
               [u_acts, 0.0, u_acts * g_out, u_acts * 4 * eta * d_out],
               [0.0, u_grads, u_grads * g_in, u_grads * 4 * eta * d_in]]
    return torch.tensor(weights, dtype=torch.float64, device=device)


def gram_bound(grad_norms: torch.Tensor, width: int, unit_roundoff: float) -> torch.Tensor:
    """``[N]`` float64: a bound on a computed ``Σ_{t,s} wₜₛ (gₜ·gₛ)`` with ``|wₜₛ| ≤ 1`` (an Embedding's index
    equalities) from one Gram of ``width``-vectors whose token norms' upper bounds are ``grad_norms`` (``[N, T]``):
    ``(γ + 2^-23 + T²·2^-52)·(Σ‖gₜ‖)² + T²·E``."""
    tokens = grad_norms.shape[1]
    sums = grad_norms.sum(1)
    error = width * 4 * SMALLEST_NORMAL * (1 + sums)
    return (gamma(width, unit_roundoff) + 2.0**-23 + tokens**2 * 2.0**-52) * sums.square() + tokens**2 * error


def squares_bound(squares: torch.Tensor, terms: int) -> torch.Tensor:
    """An upper bound on a squared norm of ``terms`` float32 entries whose squares (each rounded once) were summed
    in float64 into ``squares``, in any order: ``(1 + 2^-22)·squares + terms·η``. The slack covers the squares'
    rounding (2^-24) and the float64 sum's (``γ_terms`` at 2^-53) up to :data:`MAX_SQUARED_TERMS` terms."""
    if terms > MAX_SQUARED_TERMS:
        raise ValueError(f"a squared norm summed from {terms:,} entries per sample is beyond the rounding bound's "
                         f"reach of {MAX_SQUARED_TERMS:,}: the model has too many materialised parameters (biases, "
                         "norms, tokens)")
    return squares * (1 + 2.0**-22) + terms * SMALLEST_NORMAL


def clip_factors(values: torch.Tensor, max_grad_norm: float, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B]`` float32 clip factors ``f = min(1, (C − Z) / (U + M))``, rounded down to float32, from ``values``
    (``[4, B]`` float64 rows: computed squared norm, ``U²``, ``M²``, ``Z``); 0 for a sample not ``real`` (padding)
    or whose bounds are not finite, which then contributes nothing. And whether any row, padding included, was not
    finite (a 0-dim bool tensor): only then must the sums clear non-finite entries (0 × inf is NaN), and the samples
    of its microbatch be computed again apart (a kernel may spread a non-finite row into its neighbours)."""
    _, squared, margin, absolute = values
    factors = ((max_grad_norm - absolute) / (squared.sqrt() + margin.sqrt())).clamp(0.0, 1.0)  # [B] float64
    finite = torch.isfinite(squared + margin + absolute)
    return torch.where(real & finite, factors * FACTOR_ROUNDING, 0.0).float(), (~finite).any()


# ------------------------------------------------------------------------------------------------ IEEE float32


_PRECISION_LOCK = threading.Lock()
_ieee_users = 0
_saved: list[Any] = []


def _fp32_backends() -> list[Any]:
    """The backends whose float32 matmuls or convolutions may run at reduced precision (TF32, bfloat16)."""
    backends = torch.backends
    return [b for b in (backends.cuda.matmul, backends.cudnn.conv, backends.mkldnn.matmul, backends.mkldnn.conv)
            if hasattr(b, "fp32_precision")]


def cpu_float32_is_ieee() -> bool:
    """Whether the CPU's float32 matmuls and convolutions are IEEE already (torch's defaults), so that a thread
    entering :func:`ieee_float32` changes nothing another thread's CPU operations compute."""
    inherited = getattr(torch.backends, "fp32_precision", "none") in ("none", "ieee")
    backends = [b for b in (torch.backends.mkldnn.matmul, torch.backends.mkldnn.conv) if hasattr(b, "fp32_precision")]
    if not all(b.fp32_precision == "ieee" or (b.fp32_precision == "none" and inherited) for b in backends):
        return False
    return _legacy_precision() == "highest"


def _legacy_precision() -> str | None:
    """torch's legacy float32 matmul precision, or None where the per-backend settings (torch's newer API) give it
    no single value: torch then refuses to report one."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """IEEE float32 matmuls and convolutions (no TF32 on CUDA, no bfloat16 in oneDNN) and autocast off, while any
    thread is inside: the settings are the process's, so the first thread in saves them and the last one out
    restores them (torch's legacy matmul precision kept in agreement, which its TF32 check needs, and left as it was
    where the per-backend settings give it no value)."""
    global _ieee_users
    with _PRECISION_LOCK:
        if _ieee_users == 0:
            _saved[:] = [_legacy_precision(), [b.fp32_precision for b in _fp32_backends()]]
            torch.set_float32_matmul_precision("highest")
            for backend in _fp32_backends():
                backend.fp32_precision = "ieee"
        _ieee_users += 1
    try:
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            yield
    finally:
        with _PRECISION_LOCK:
            _ieee_users -= 1
            if _ieee_users == 0:
                if _saved[0] is not None:
                    torch.set_float32_matmul_precision(_saved[0])
                for backend, saved in zip(_fp32_backends(), _saved[1]):
                    backend.fp32_precision = saved
