"""The privatized gradient: per-sample clipping over all parameters, Gaussian noise, division by the
expected batch size.

:func:`privatized_gradients` sets each trainable parameter's ``.grad`` to

    (Σᵢ clip(gᵢ, C) + N(0, σ²C²I)) / expected_batch_size

where ``gᵢ`` is sample i's gradient over *all* trainable parameters (flat clipping), the noise is drawn once
per call (never per microbatch) and the divisor is the public expected batch size, never the realised count.

How it is fast (book-keeping): one forward, then one backward that asks autograd only for activation
gradients, so no layer computes its weight gradient. Forward hooks keep each supported layer's input
``A``; an identity autograd node after the layer hands its output gradient ``G`` to the layer's
:class:`~vip_core.privacy.per_sample.Rule`, which computes per-sample norms (ghost norm or materialised,
whichever is cheaper) and, once the clipping factors are known, the clipped sum with no second backward.
Plain parameters of shape ``[1, ...]`` (cls/mask tokens, learnt position embeddings) are replaced during
the forward by a per-sample stand-in ``[B, ...]`` whose gradient is per sample.

What is refused, with an error naming the layer: a trainable parameter of any other layer type, a plain
parameter whose leading dimension is not 1, a layer whose input or output does not have the microbatch on
dim 0, a model in which a layer's output row or a plain parameter's stand-in row reaches another sample's
loss (a sequence-first layout; a ``[1, D]`` parameter added to ``[B, T, D]``, which would mix samples
silently when B = T: checked on the first microbatches of two or more samples until every layer and
parameter was reached, each check one extra forward and two backward passes, so a loss function is called
once more than there are microbatches then), batch normalisation in training mode (it mixes samples), a
supported layer whose weight is also used outside its own forward (tied weights), an ``Embedding`` with
``scale_grad_by_freq`` or ``sparse``, a layer input modified in place after the layer ran, a layer input or output
gradient kept for the norms (Linear, Conv2d, Embedding) and modified in place before the norms and the clipped
sum use it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import warnings
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.profiler import record_function
from torch.utils.weak import WeakIdKeyDictionary

from vip_core.privacy.per_sample import (
    RULES, TENSOR_CORE_MIN_CLIP, GramBounds, PerSample, PlainRule, Rule, Sums, add_materialised_sums,
    decide_conditioning, has_tensor_cores, materialised_squared_norms,
)
from vip_core.privacy.randomness import GaussianDraw, RandomStream

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]
Inputs = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]

CLIP_EPS = 1e-6
# Subclasses whose own forward computes exactly their base layer's function of (input, weight, bias).
EQUIVALENT_SUBCLASSES = frozenset({"timm.layers.norm.LayerNorm", "timm.layers.linear.Linear"})
_CAST_NODES = ("ToCopyBackward0",)


class UnsupportedLayerError(ValueError):
    """A trainable layer or parameter the engine cannot clip per sample; the message names it."""


@dataclass(frozen=True)
class StepStats:
    """What one call saw. Data-dependent and NOT privatized: for monitoring only, never to release.

    Attributes:
        examples: the realised number of examples.
        loss_sum: the sum of their losses.
        clipped: how many had a gradient norm above the clipping bound.
        non_finite: how many had a non-finite gradient (they contribute nothing).
    """

    examples: int
    loss_sum: float
    clipped: int
    non_finite: int


def privatized_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Inputs,
    *,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    physical_batch_size: int | None = None,
    noise: RandomStream | None = None,
    tensor_core_sums: bool = False,
) -> StepStats:
    """Sets ``.grad`` of every trainable parameter of ``model`` to the privatized mean gradient.

    Args:
        model: the model; every trainable parameter must belong to a supported layer (Linear, Conv2d,
            LayerNorm, Embedding) or be a plain parameter with leading dimension 1.
        loss_fn: ``loss_fn(model, inputs) -> [B]`` losses, one per sample, each depending on its own sample only.
        inputs: a tensor, or a tuple/list/dict of tensors, all with the batch on dim 0 (may be empty).
        max_grad_norm: the clipping bound C on each sample's gradient norm over all parameters.
        noise_multiplier: σ; the noise standard deviation is σC (0 for no noise, e.g. on ranks other than 0).
        expected_batch_size: the public expected logical batch size (q·N) the sum is divided by.
        physical_batch_size: microbatch size bounding memory; the whole batch at once when None.
        noise: the random stream of the noise; required when ``noise_multiplier`` > 0.
        tensor_core_sums: on CUDA, the clipped sums of bfloat16 layers on tensor cores
            (:func:`~vip_core.privacy.per_sample.splits_on_tensor_cores`).

    Returns:
        Monitoring statistics of the batch (not private).
    """
    _check_arguments(max_grad_norm, noise_multiplier, expected_batch_size, physical_batch_size)
    clipped = ClippedGradientSum(model, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier, noise=noise,
                                 tensor_core_sums=tensor_core_sums)
    clipped.add(loss_fn, inputs, physical_batch_size=physical_batch_size)
    return clipped.privatize(expected_batch_size=expected_batch_size)


class ClippedGradientSum:
    """The running sum Σᵢ clip(gᵢ, C) over any number of microbatches of one logical batch, plus the noise
    once. Use it to stream a logical batch from disk one physical batch at a time;
    :func:`privatized_gradients` is the one-call form.

    The noise is one :class:`~vip_core.privacy.randomness.GaussianDraw` taken when the sum is created. The CPU
    parameters' noise is drawn on helper threads into a few flat buffers of consecutive parameters, each
    parameter's share a view of one, and the clipped sums are added into those views: for float32 parameters it
    needs no second parameter-sized buffer (the privatized gradients are views of them too). When torch leaves
    cores idle, the helpers use them while the first backward runs (the draw starts when the backward reaches its
    first layer), and where they leave at least as many idle cores as torch's threads (a helper's torch operations
    run that many), the helpers also compute each layer's ghost norm (its Gram matrices and token norms) as soon as
    the backward has reached the layer, so that little of the work the non-private step does not have is left on the
    calling thread; the values are the same wherever they are computed. Otherwise the helpers draw the noise once
    the first microbatch's clip factors are known, before its clipped sums, because helpers competing with torch's
    threads for the cores would slow its matmuls more than the draw costs. The values do not depend on the threads or
    the microbatches. One object sums and privatizes one logical batch: after :meth:`privatize`, or after a call that
    failed part-way, it refuses to go on.

    Args:
        model: the model (see :func:`privatized_gradients` for what it may contain).
        max_grad_norm: the clipping bound C.
        noise_multiplier: σ; the noise standard deviation is σC (0 on the ranks that add no noise).
        noise: the random stream of the noise; required when σ > 0.
        tensor_core_sums: on CUDA, the clipped sums of bfloat16 layers on tensor cores
            (:func:`~vip_core.privacy.per_sample.splits_on_tensor_cores`; ``docs/privacy.md`` says what it costs).
    """

    def __init__(self, model: nn.Module, *, max_grad_norm: float, noise_multiplier: float = 0.0,
                 noise: RandomStream | None = None, tensor_core_sums: bool = False) -> None:
        _check_arguments(max_grad_norm, noise_multiplier, 1.0, None)
        if tensor_core_sums and max_grad_norm < TENSOR_CORE_MIN_CLIP:
            raise ValueError(f"tensor_core_sums needs max_grad_norm >= {TENSOR_CORE_MIN_CLIP:g}, got "
                             f"{max_grad_norm!r}: below it their bfloat16 parts' underflow is not negligible beside C")
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.tensor_core_sums = tensor_core_sums
        self.plan = plan_model(model)
        if tensor_core_sums and not any(has_tensor_cores(p.device) for p in self.plan.params):
            warnings.warn("tensor_core_sums has no effect here: no trainable parameter is on a CUDA device, so the "
                          "clipped sums stay IEEE float32", stacklevel=2)
        if noise_multiplier > 0 and noise is None:
            raise ValueError("noise_multiplier > 0 needs a noise stream (a RandomStream), never a default generator")
        for param in (*self.plan.params, *self.plan.frozen):
            param.grad = None  # the previous step's gradients are dead weight, and a frozen one's would be applied
        self.sums: Sums = {}
        self.totals = _Totals()
        draw = GaussianDraw(noise, noise_multiplier * max_grad_norm) if noise_multiplier > 0 else None
        threads = torch.get_num_threads()
        idle = usable_cores() - threads
        self.helpers = idle_core_helpers(idle)
        self.handed: list[Future] = []  # the ghost norms handed to the helpers
        # The ghost norms go to the helpers only where a helper's torch operations (on torch's number of threads) fit
        # the idle cores beside the step's own.
        self.norm_helpers = self._hand_over if self.helpers is not None and idle >= threads else None
        self.noise = _StepNoise(self.plan.params, draw, self.helpers)
        self.closed: str | None = None  # why it refuses to go on, once it does

    def add(self, loss_fn: LossFn, inputs: Inputs, *, physical_batch_size: int | None = None) -> None:
        """Adds the clipped per-sample gradients of ``inputs``, in microbatches of ``physical_batch_size``."""
        self._check_open()
        with self._closed_on_error():
            for chunk in split_batch(inputs, physical_batch_size):
                _add_microbatch(self.plan, self.model, loss_fn, chunk, self.max_grad_norm, self.sums, self.totals,
                                self.noise, self.tensor_core_sums, self.norm_helpers)
            self._finish_handed()  # what a layer's second call dropped may still run: not past this call

    def privatize(self, *, expected_batch_size: float) -> StepStats:
        """Sets each trainable parameter's ``.grad`` to (sum + N(0, σ²C²I)) / expected_batch_size.

        Args:
            expected_batch_size: the public divisor q·N.

        Returns:
            Monitoring statistics of the batch (not private).
        """
        _check_arguments(self.max_grad_norm, 0.0, expected_batch_size, None)
        self._check_open()
        self.closed = "was privatized already: its noise is spent, so it cannot sum or privatize another batch"
        with self._closed_on_error():
            self.noise.settle(self.plan.params, self.sums)
        self._finish_handed()
        divided = self.noise.divide_in_place(self.sums, expected_batch_size)
        for param in self.plan.params:
            total = self.sums.pop(param) if param in self.sums else torch.zeros_like(param)
            param.grad = total if param in divided else total.div_(expected_batch_size)
        t = self.totals
        return StepStats(t.examples, float(t.loss_sum), int(t.clipped), int(t.non_finite))

    def _check_open(self) -> None:
        if self.closed is not None:
            raise RuntimeError(f"this ClippedGradientSum {self.closed}; create one per logical batch")

    @contextlib.contextmanager
    def _closed_on_error(self) -> Iterator[None]:
        """Closes the sum and stops the noise threads when the enclosed code raises: the sums then hold part of a
        batch, and going on (a retried microbatch) would count some samples twice against noise sized for once."""
        try:
            yield
        except BaseException:
            self.closed = "failed part-way: its sums hold part of a batch, so it cannot go on"
            self.noise.stop()
            self._finish_handed()
            raise

    def _hand_over(self, function: Callable, *args: Any) -> Future:
        """Runs ``function(*args)`` on a helper thread in full float32 (:func:`_in_full_float32`)."""
        future = self.helpers.submit(_in_full_float32, function, *args)
        self.handed.append(future)
        return future

    def _finish_handed(self) -> None:
        """Cancels the ghost norms handed to the helpers that no helper has started (a layer's first call's, dropped by
        its second call; all of a call that failed) and waits for the ones running: none may outlive the call that
        handed it over, since a helper inside :func:`full_float32` keeps the process's float32 settings as the call
        found them, which the next one would then not set. The helpers stay for the next step."""
        for future in self.handed:
            future.cancel()
        wait(self.handed)


def _in_full_float32(function: Callable, *args: Any) -> Any:
    """``function(*args)`` in :func:`full_float32` without autograd: a helper thread's autocast and grad mode are its
    own, not the step's."""
    with torch.no_grad(), full_float32(torch.device("cpu")):
        return function(*args)


_HELPERS_LOCK = threading.Lock()
_helpers: dict[int, ThreadPoolExecutor] = {}  # the process's idle-core helpers, by their number


def idle_core_helpers(idle: int) -> ThreadPoolExecutor | None:
    """The process's ``idle`` helper threads for the cores torch's threads leave idle (None for none), kept from step to
    step: a thread's first matmul costs 3-8 ms of BLAS set-up here, which helpers made afresh paid every step. One pool
    per count, so a step holding one is never left with a stopped pool, and the threads stay bounded by the cores."""
    if idle <= 0:
        return None
    with _HELPERS_LOCK:
        if idle not in _helpers:
            _helpers[idle] = ThreadPoolExecutor(idle, "vip-helper")
        return _helpers[idle]


def _forget_helpers() -> None:
    """In a forked child: the parent's helper threads are not there."""
    _helpers.clear()


os.register_at_fork(after_in_child=_forget_helpers)


HELPER_DRAWN_DEVICES = frozenset({"cpu"})  # device types whose noise helper threads draw; the others draw their own
# The most coordinates of a helper-drawn noise vector that holds several parameters (4 MiB of float32), so that a
# step's noise is allocated as the non-private gradients are: in pieces the allocator takes back and hands out again
# from step to step. One vector of every parameter (72 MB at ViP-Nano) was mapped afresh each step, and its pages were
# zeroed by the operating system on first touch: about 30 ms of CPU a ViP-Nano step, 0.2 s at ViP-Base.
NOISE_VECTOR = 1 << 20


@dataclass(eq=False)
class _NoiseVector:
    """The noise of consecutive parameters of one device: tensor ``index`` of the step's draw, ``size`` coordinates."""

    device: torch.device
    index: int
    size: int = 0
    helper_drawn: bool = False  # drawn by helper threads block by block (else whole, on its device)
    values: torch.Tensor | None = None  # [size] float32, once allocated (helper-drawn) or drawn (on the device)
    futures: list[Future] = field(default_factory=list)  # one per block, once handed to the helpers


class _StepNoise:
    """A step's noise, one :class:`GaussianDraw` over the trainable parameters (none when σ = 0).

    The noise is drawn as a few flat float32 vectors, in ``params`` order, each parameter's share a view of one of
    them: tensors ``len(params)``, ``len(params) + 1``, ... of the draw, in the order the vectors come. A device whose
    noise helper threads draw (the CPU) gets vectors of consecutive parameters of at most ``NOISE_VECTOR`` coordinates
    (a larger parameter alone in one): :meth:`start` allocates them (on the calling thread) and hands their blocks to
    helpers: ``idle_helpers``, the caller's threads on the cores torch's threads leave idle, whose draws start when the
    first backward reaches a layer (:meth:`start_early`), or else its own ``torch.get_num_threads()``, which draw
    everything before the clipped sums (:meth:`draw_all`) while the calling thread waits. Any other device gets one
    vector of all its parameters, drawn on the device, whole, when :meth:`settle` first needs it. :meth:`settle`
    waits for a parameter's noise and makes it the start of its running sum: each parameter's noise enters the sum
    exactly once, whatever the number of microbatches.
    """

    def __init__(self, params: list[nn.Parameter], draw: GaussianDraw | None,
                 idle_helpers: ThreadPoolExecutor | None) -> None:
        self.draw = draw
        self.first_index = len(params)  # the draw's tensor index of the first vector
        self.shares: dict[nn.Parameter, tuple[_NoiseVector, int]] = {}  # each parameter's vector and first coordinate
        self.vectors: list[_NoiseVector] = []
        own: dict[torch.device, _NoiseVector] = {}  # the one vector of each device that draws its own
        for param in params:
            if param.device.type in HELPER_DRAWN_DEVICES:
                vector = self._helped_vector(param.device, param.numel())
            elif param.device in own:
                vector = own[param.device]
            else:
                vector = own[param.device] = self._new(param.device)
            self.shares[param] = (vector, vector.size)
            vector.size += param.numel()
        self.helped = [v for v in self.vectors if v.device.type in HELPER_DRAWN_DEVICES and v.size]
        for vector in self.helped:
            vector.helper_drawn = True
        self.settled: dict[nn.Parameter, torch.Tensor] = {}  # each settled parameter's noise, its running sum's start
        self.started = False
        self.starting = threading.Lock()  # start() may be called from autograd's device threads at once
        self.early = False  # drawn by the idle cores' helpers (kept between steps), else by a pool of its own
        self.pool: ThreadPoolExecutor | None = None
        if draw is not None and self.helped:
            self.early = idle_helpers is not None
            self.pool = idle_helpers or ThreadPoolExecutor(max(1, torch.get_num_threads()), "vip-noise")

    def _helped_vector(self, device: torch.device, numel: int) -> _NoiseVector:
        """The helper-drawn vector that a parameter of ``numel`` coordinates on ``device`` joins: the last vector, if it
        is that device's and stays within ``NOISE_VECTOR`` coordinates (or is empty), else a new one."""
        last = self.vectors[-1] if self.vectors else None
        if last is not None and last.device == device and (last.size == 0 or last.size + numel <= NOISE_VECTOR):
            return last
        return self._new(device)

    def _new(self, device: torch.device) -> _NoiseVector:
        self.vectors.append(_NoiseVector(device, self.first_index + len(self.vectors)))
        return self.vectors[-1]

    def start_early(self) -> None:
        """:meth:`start`, when helper threads have idle cores to run on during the backward."""
        if self.early:
            self.start()

    def start(self) -> None:
        """Allocates the helper-drawn vectors and starts the helpers drawing them (once; a caller that comes while
        another is at it returns when every vector has been handed over)."""
        if self.draw is None:
            return
        with self.starting:
            if self.started:
                return
            self.started = True
            for vector in self.helped:
                vector.values = torch.empty(vector.size, dtype=torch.float32, device=vector.device)
                vector.futures = [self.pool.submit(self.draw.fill, vector.index, vector.values, block)
                                  for block in GaussianDraw.blocks(vector.size)]

    def draw_all(self) -> None:
        """:meth:`start`; when the helpers have no idle cores of their own, also waits for every draw, so that they
        do not compete with the clipped sums' matmuls for the cores."""
        self.start()
        if self.early:
            return
        with record_function("vip.noise_wait"):
            for vector in self.helped:
                for future in vector.futures:
                    future.result()

    def settle(self, params: Sequence[nn.Parameter], sums: Sums) -> None:
        """Adds the noise of each of ``params`` not settled yet to ``sums`` (becoming its entry)."""
        if self.draw is None:
            return
        self.start()
        for param in params:
            if param in self.settled:
                continue
            noise = self._share(param)
            if param in sums:
                noise.add_(sums[param])
            sums[param] = noise
            self.settled[param] = noise
        if len(self.settled) == len(self.shares) and self._own_pool():
            self.pool.shutdown(wait=False)

    def divide_in_place(self, sums: Sums, divisor: float) -> set[nn.Parameter]:
        """Divides every noise vector by ``divisor`` in place, one operation per vector instead of one per
        parameter, and returns the parameters whose running sum in ``sums`` is still the very view of a vector that
        :meth:`settle` made it (divided with it); every other sum is the caller's to divide."""
        for vector in self.vectors:
            if vector.values is not None:
                vector.values.div_(divisor)
        return {param for param, noise in self.settled.items()
                if sums.get(param) is noise and noise.dtype == torch.float32}

    def _share(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s view of its vector, once drawn. A parameter that is not float32 gets a copy in its dtype, and its
        share of the vector is zeroed: the other parameters' gradients are views of that vector, and whoever saves
        one saves the whole storage, which must not hold this parameter's noise apart from its sum."""
        vector, start = self.shares[param]
        stop = start + param.numel()
        if vector.helper_drawn:
            self._wait(vector, GaussianDraw.blocks_spanning(start, stop))
        elif vector.values is None:
            vector.values = self.draw.tensor(vector.index, (vector.size,), device=vector.device)
        share = vector.values[start:stop].view(param.shape)
        if param.dtype == torch.float32:
            return share
        noise = share.to(param.dtype)
        share.zero_()
        return noise

    def _wait(self, vector: _NoiseVector, blocks: range) -> None:
        """Waits for the helpers' ``blocks`` of ``vector``, raising what a helper raised, or that the vector's blocks
        were not all handed to the helpers (its memory would be read as noise where no draw wrote it)."""
        if len(vector.futures) != len(GaussianDraw.blocks(vector.size)):
            raise RuntimeError(f"the noise of draw tensor {vector.index} was not handed to the helper threads whole")
        waits = [vector.futures[block] for block in blocks]
        if not all(future.done() for future in waits):
            with record_function("vip.noise_wait"):
                wait(waits)
        for future in waits:
            future.result()

    def _own_pool(self) -> bool:
        """Whether the pool is this noise's, to stop once it is settled (the idle cores' helpers stay)."""
        return self.pool is not None and not self.early

    def stop(self) -> None:
        """Stops the draws no helper has started: its own helper threads with them, or its blocks queued on the idle
        cores' helpers, which stay for the next step."""
        if self._own_pool():
            self.pool.shutdown(wait=False, cancel_futures=True)
        for vector in self.helped:
            for future in vector.futures:
                future.cancel()


def usable_cores() -> int:
    """The cores this process may run on (all of the machine's where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _check_arguments(
    max_grad_norm: float, noise_multiplier: float, expected_batch_size: float, physical_batch_size: int | None
) -> None:
    if not 0 < max_grad_norm < float("inf"):  # an infinite C would clip nothing
        raise ValueError(f"max_grad_norm must be finite and > 0, got {max_grad_norm}")
    if not 0 <= noise_multiplier < float("inf"):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier}")
    if not expected_batch_size > 0:
        raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size}")
    if physical_batch_size is not None and physical_batch_size <= 0:
        raise ValueError(f"physical_batch_size must be > 0, got {physical_batch_size}")


# ------------------------------------------------------------------------------------------------ planning


@dataclass
class ModelPlan:
    """Which rule covers which trainable parameter.

    Attributes:
        layers: ``(qualified name, module, rule factory)`` for each hooked layer.
        plain: ``(qualified parameter name, parameter)`` for each plain parameter.
        params: every trainable parameter, in the order of the walk (``model.named_parameters()``'s).
        frozen: the parameters the model lists that are not trainable (their gradients are dropped each step).
    """

    layers: list[tuple[str, nn.Module, Callable[[str, nn.Module], Rule]]]
    plain: list[tuple[str, nn.Parameter]]
    params: list[nn.Parameter]
    frozen: list[nn.Parameter]


def plan_model(model: nn.Module) -> ModelPlan:
    """Assigns every trainable parameter of ``model`` to a rule, or raises naming what cannot be handled.

    Each module's parameters are read from its own table (``module._parameters``), which is where a plain parameter's
    per-sample stand-in is swapped in by name (and must lead there). Where the model or a module in it overrides how it
    lists its parameters or modules, the model's ``named_parameters()`` and ``parameters()`` (what an optimiser is built
    from) must each list exactly the trainable parameters planned, and such a module no other trainable one; where
    none does, the stock listings are the walk's by construction.

    Raises:
        UnsupportedLayerError: for a layer or parameter the engine cannot clip per sample.
    """
    layers: list[tuple[str, nn.Module, Callable[[str, nn.Module], Rule]]] = []
    plain: list[tuple[str, nn.Parameter]] = []
    owners: dict[nn.Parameter, str] = {}  # every trainable parameter, in model.parameters() order
    frozen: dict[int, nn.Parameter] = {}  # the parameters that are not trainable (by id), whose gradients are dropped
    # the modules overriding how they list parameters or modules: each is looked at in its parent's table, where one
    # hiding itself from the walk is still found
    listing_their_own = [("", model)] if _lists_its_own_members(model) else []
    for module_name, module in model.named_modules(remove_duplicate=False):
        _reject_batch_norm(module_name, module)
        for child_name, child in module._modules.items():
            if child is not None and _lists_its_own_members(child):
                listing_their_own.append((f"{module_name}.{child_name}" if module_name else child_name, child))
        for param in module._parameters.values():
            if param is not None and not param.requires_grad:
                frozen[id(param)] = param
        trainable = _own_trainable_parameters(module)
        for param_name, param in trainable.items():
            qualified = f"{module_name}.{param_name}" if module_name else param_name
            _check_tracked_by_identity(qualified, param)
            if param in owners:
                raise UnsupportedLayerError(
                    f"parameter '{qualified}' is the same tensor as '{owners[param]}': shared (tied) "
                    "parameters cannot be clipped per sample"
                )
            owners[param] = qualified
        if not trainable:
            continue
        factory = _supported_rule(module_name, module)
        if factory is not None:
            layers.append((module_name, module, factory))
            continue
        for param_name, param in trainable.items():
            qualified = f"{module_name}.{param_name}" if module_name else param_name
            _check_plain(qualified, module_name, module, param)
            _check_reached_by_name(model, qualified, param)
            plain.append((qualified, param))
    if listing_their_own:
        frozen.update((id(param), param) for param in _check_listed_parameters(model, owners, listing_their_own))
    return ModelPlan(layers, plain, list(owners), list(frozen.values()))


_TENSOR_METACLASSES = (type(torch.Tensor), type(nn.Parameter))


def _check_tracked_by_identity(qualified: str, param: nn.Parameter) -> None:
    """Refuses a parameter whose type hashes or compares by something other than identity: the engine keys each
    parameter's sums, noise and checks by the parameter, and two such parameters of equal values would share them.
    Read from the raw tables of the parameter's own classes (those before ``torch.Tensor``), under torch's own
    metaclasses: a metaclass of its own could report torch.Tensor's methods while instances use others."""
    kind = type(param)
    own_classes = kind.__mro__[:kind.__mro__.index(torch.Tensor)] if type(kind) in _TENSOR_METACLASSES else None
    if own_classes is None or any("__hash__" in vars(cls) or "__eq__" in vars(cls) for cls in own_classes):
        raise UnsupportedLayerError(
            f"parameter '{qualified}' is a {kind.__name__} with a hash or equality of its own: the engine tells "
            "parameters apart by identity"
        )


def _own_trainable_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable parameters of ``module``'s own table, each once (under its first name)."""
    trainable: dict[str, nn.Parameter] = {}
    for name, param in module._parameters.items():
        if param is not None and param.requires_grad and all(param is not seen for seen in trainable.values()):
            trainable[name] = param
    return trainable


def _check_reached_by_name(model: nn.Module, qualified: str, param: nn.Parameter) -> None:
    """Refuses a plain parameter that its qualified name does not lead to the way its stand-in is swapped in
    (``functional_call``: ``getattr`` along the path, then the module's own table): a class whose ``named_modules``
    gave two modules each other's names had each stand-in's per-sample gradients given to the other parameter."""
    *path, last = qualified.split(".")
    owner: Any = model
    for part in path:
        owner = getattr(owner, part, None)
    if not isinstance(owner, nn.Module) or last not in owner._parameters or owner._parameters[last] is not param:
        raise UnsupportedLayerError(
            f"plain parameter '{qualified}' is not the model's attribute of that name (a class listing its modules "
            "or parameters under other names): its per-sample copy could not be swapped in by name"
        )


_LISTINGS = frozenset({"named_parameters", "parameters", "named_modules", "_named_members"})


def _lists_its_own_members(module: nn.Module) -> bool:
    """Whether ``module``'s class or the instance itself overrides how it lists its parameters or modules (or how its
    attributes are read, or its class has a metaclass of its own)."""
    cls = type(module)  # each comparison spelled out: a loop over the names costs twice as much, per module and step
    return (cls.named_parameters is not nn.Module.named_parameters or cls.parameters is not nn.Module.parameters
            or cls.named_modules is not nn.Module.named_modules or cls._named_members is not nn.Module._named_members
            or cls.__getattribute__ is not nn.Module.__getattribute__ or type(cls) is not type
            or not _LISTINGS.isdisjoint(vars(module)))


def _check_listed_parameters(model: nn.Module, owners: dict[nn.Parameter, str],
                             listing_their_own: list[tuple[str, nn.Module]]) -> list[nn.Parameter]:
    """Refuses a model whose ``named_parameters()`` or ``parameters()`` lists a trainable parameter the walk of its
    modules did not plan (an optimiser would train it unclipped and un-noised, with whatever gradient it holds), or
    leaves out one that it planned (its gradient would count in every sample's norm, and it would never be trained);
    and a module overriding how it lists its parameters or modules (an optimiser's group may be built from it) that
    lists a trainable parameter the walk did not plan. Parameters are compared by identity. Returns the frozen
    parameters the listings give."""
    planned = {id(param) for param in owners}
    named = list(model.named_parameters())
    names = {id(param): name for name, param in named}
    listings = {"the model's named_parameters()": [param for _, param in named],
                "the model's parameters()": list(model.parameters())}
    for module_name, module in listing_their_own:
        listings[f"'{module_name}' ({type(module).__name__})"] = [*(p for _, p in module.named_parameters()),
                                                                  *module.parameters()]
    for listing, params in listings.items():
        for param in params:
            if param.requires_grad and id(param) not in planned:
                name = names.get(id(param), f"(unnamed) {list(param.shape)}")
                raise UnsupportedLayerError(
                    f"parameter '{name}' is listed by {listing} but not reached by the walk of its modules' own "
                    "tables: it cannot be clipped per sample"
                )
    for listing in ("the model's named_parameters()", "the model's parameters()"):
        listed = {id(param) for param in listings[listing] if param.requires_grad}
        for param, name in owners.items():
            if id(param) not in listed:
                raise UnsupportedLayerError(
                    f"parameter '{name}' is left out of {listing}: an optimiser would not train it while its "
                    "gradient counted in every sample's norm (set requires_grad=False to freeze it)"
                )
    return [param for params in listings.values() for param in params if not param.requires_grad]


def _reject_batch_norm(name: str, module: nn.Module) -> None:
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
        raise UnsupportedLayerError(
            f"layer '{name or 'model'}' ({type(module).__name__}) mixes the samples of a batch in training "
            "mode, which per-sample clipping cannot bound: use LayerNorm or GroupNorm"
        )


def _supported_rule(name: str, module: nn.Module) -> Callable[[str, nn.Module], Rule] | None:
    """The rule factory for a supported layer whose forward is the stock one (or a known equivalent)."""
    for layer_type, factory in RULES.items():
        if isinstance(module, layer_type) and _stock_forward(type(module), layer_type):
            if isinstance(module, nn.Embedding) and (module.scale_grad_by_freq or module.sparse):
                raise UnsupportedLayerError(
                    f"layer '{name}' (Embedding): scale_grad_by_freq and sparse gradients are not supported"
                )
            return factory
    return None


def _stock_forward(cls: type, layer_type: type) -> bool:
    return cls.forward is layer_type.forward or f"{cls.__module__}.{cls.__qualname__}" in EQUIVALENT_SUBCLASSES


def _check_plain(qualified: str, module_name: str, module: nn.Module, param: nn.Parameter) -> None:
    if param.dim() >= 2 and param.shape[0] == 1:
        return
    raise UnsupportedLayerError(
        f"cannot clip parameter '{qualified}' {list(param.shape)} of layer '{module_name or 'model'}' "
        f"({type(module).__name__}) per sample: supported are Linear, Conv2d, LayerNorm and Embedding layers "
        "and plain parameters of shape [1, ...] broadcast against the batch"
    )


# ------------------------------------------------------------------------------------------------ batches


def batch_size_of(inputs: Inputs) -> int:
    """The batch size shared by every tensor of ``inputs`` (dim 0)."""
    sizes = {t.shape[0] for t in _tensors(inputs)}
    if len(sizes) != 1:
        raise ValueError(f"inputs must share one batch size on dim 0, got sizes {sorted(sizes)}")
    return sizes.pop()


def _tensors(inputs: Inputs) -> list[torch.Tensor]:
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    values = list(inputs.values()) if isinstance(inputs, Mapping) else list(inputs)
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        raise ValueError("inputs must be a tensor or a non-empty tuple, list or dict of tensors")
    return values


def split_batch(inputs: Inputs, physical_batch_size: int | None) -> Iterator[Inputs]:
    """Yields consecutive microbatches of at most ``physical_batch_size`` samples (nothing when empty)."""
    size = batch_size_of(inputs)
    step = physical_batch_size or max(size, 1)
    for start in range(0, size, step):
        yield _slice(inputs, start, start + step)


def _slice(inputs: Inputs, start: int, stop: int) -> Inputs:
    if isinstance(inputs, torch.Tensor):
        return inputs[start:stop]
    if isinstance(inputs, Mapping):
        return {key: value[start:stop] for key, value in inputs.items()}
    return type(inputs)(value[start:stop] for value in inputs)


# ------------------------------------------------------------------------------------------------ one microbatch


@dataclass
class _Totals:
    """Running statistics; the tensor ones stay on the device until the end (no sync per microbatch)."""

    examples: int = 0
    loss_sum: float | torch.Tensor = 0.0
    clipped: int | torch.Tensor = 0
    non_finite: int | torch.Tensor = 0


class _Capture(torch.autograd.Function):
    """Identity on a layer output whose backward hands the output gradient to a callback. It marks its
    input dirty, so the output keeps its identity and later in-place ops (e.g. ReLU(inplace)) still see
    the gradient of the layer's own output. ``anchor`` makes autograd traverse every capture."""

    @staticmethod
    def forward(
        ctx: Any, output: torch.Tensor, anchor: torch.Tensor, layer: nn.Module, callback: Callable
    ) -> torch.Tensor:
        ctx.layer = layer
        ctx.callback = callback
        ctx.mark_dirty(output)
        return output

    @staticmethod
    def backward(ctx: Any, output_grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.callback(output_grad)
        return output_grad, None, None, None


class _Tape:
    """Forward hooks on the supported layers that keep each call's input and route its output gradient."""

    def __init__(self, plan: ModelPlan, batch: int, on_gradient: Callable[[], None],
                 norm_helpers: Callable[..., Future] | None) -> None:
        self.batch = batch
        self.on_gradient = on_gradient
        self.norm_helpers = norm_helpers
        self.anchor = torch.zeros((), requires_grad=True)
        self.rules: list[tuple[nn.Module, Rule]] = [(m, factory(n, m)) for n, m, factory in plan.layers]
        _check_rule_coverage(self.rules, plan.plain)
        decide_conditioning([rule for _, rule in self.rules])
        self.handles: list[Any] = []

    def __enter__(self) -> "_Tape":
        for module, rule in self.rules:
            self.handles.append(module.register_forward_hook(self._hook(rule), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, rule: Rule) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
            if not (torch.is_grad_enabled() and output.requires_grad):
                return None
            layer_input = (args[0] if args else kwargs["input"]).detach()
            if layer_input.shape[0] != self.batch or output.shape[0] != self.batch:
                raise UnsupportedLayerError(
                    f"layer '{rule.name}' ran on an input of {layer_input.shape[0]} rows (output {output.shape[0]}) "
                    f"in a microbatch of {self.batch} samples: per-sample clipping needs the batch on dim 0"
                )
            call = _Call(rule, layer_input, self.on_gradient, self.norm_helpers)
            captured = _capture(output, self.anchor, module, call.receive)
            if rule.uses_output:
                call.keep_output(captured.detach())
            return captured

        return hook


def _check_rule_coverage(rules: list[tuple[nn.Module, Rule]], plain: list[tuple[str, nn.Parameter]]) -> None:
    """Refuses, each microbatch, a supported layer whose rule does not cover exactly the layer's own registered
    trainable parameters, and a parameter covered twice (by two rules, or by a rule and as a plain parameter; a model
    may re-register a weight in its forward after :func:`plan_model` checked it): a parameter clipped by two rules
    gets two parts each within C whose sum is not (up to √2·C when they align), and a parameter the rule does not read
    would get noise alone."""
    covered_by: dict[int, str] = {id(param): f"plain parameter '{name}'" for name, param in plain}
    for module, rule in rules:
        own = list(_own_trainable_parameters(module).values())
        if len(rule.params) != len(own) or any(all(param is not mine for mine in own) for param in rule.params):
            raise UnsupportedLayerError(
                f"layer '{rule.name}' ({type(module).__name__}) computes with parameters other than its own registered "
                "ones (e.g. a weight that is a buffer or attribute holding another parameter): it cannot be clipped "
                "per sample"
            )
        for param in rule.params:
            first = covered_by.setdefault(id(param), f"layer '{rule.name}'")
            if first != f"layer '{rule.name}'":
                raise UnsupportedLayerError(
                    f"layer '{rule.name}' and {first} cover the same parameter this microbatch (a weight shared or "
                    "re-registered after the model was planned): it would be clipped twice"
                )


class _Call:
    """One call of a layer: its input (and output, for rules that use it), checked for in-place changes; when
    its output gradient arrives it is recorded, the rule may hand part of its norms to ``norm_helpers`` (an
    executor's submit, or None), and ``on_gradient`` is called."""

    def __init__(self, rule: Rule, layer_input: torch.Tensor, on_gradient: Callable[[], None],
                 norm_helpers: Callable[..., Future] | None) -> None:
        self.rule = rule
        self.on_gradient = on_gradient
        self.norm_helpers = norm_helpers
        self.tensors = [layer_input]
        self.versions = [layer_input._version]
        self.output: torch.Tensor | None = None

    def keep_output(self, output: torch.Tensor) -> None:
        self.output = output
        self.tensors.append(output)
        self.versions.append(output._version)

    def receive(self, output_grad: torch.Tensor) -> None:
        if [t._version for t in self.tensors] != self.versions:
            raise RuntimeError(
                f"the input or output of layer '{self.rule.name}' was modified in place after the layer ran; "
                "per-sample gradients need them unchanged"
            )
        self.rule.record(self.tensors[0], self.output, output_grad)
        if self.norm_helpers is not None:
            self.rule.start_norms(self.norm_helpers)
        self.on_gradient()


def _capture(output: torch.Tensor, anchor: torch.Tensor, module: nn.Module, receive: Callable) -> torch.Tensor:
    """Routes the gradient of ``output`` to ``receive``. A view (a Linear on [B, T, d] returns one of its
    [B·T, d] result) is captured through its base, so the capture node stays visible in the graph."""
    base = output._base
    if base is None:
        return _Capture.apply(output, anchor, module, receive)
    if output.is_contiguous() and base.is_contiguous() and base.numel() == output.numel() and (
        output.storage_offset() == base.storage_offset()
    ):
        return _Capture.apply(base, anchor, module, receive).view(output.shape)
    return _Capture.apply(output.clone(), anchor, module, receive)


def _add_microbatch(
    plan: ModelPlan, model: nn.Module, loss_fn: LossFn, inputs: Inputs, max_grad_norm: float, sums: Sums,
    total: _Totals, noise: _StepNoise, tensor_core_sums: bool, norm_helpers: Callable[..., Future] | None,
) -> None:
    """Adds the clipped per-sample gradients of one microbatch to ``sums`` (each parameter's entry starting from
    its noise), on tensor cores where ``tensor_core_sums`` allows; the layers' ghost norms computed on
    ``norm_helpers`` while the backward runs, where given."""
    batch = batch_size_of(inputs)
    device = plan.params[0].device if plan.params else torch.device("cpu")
    _verify_per_sample_layout(plan, model, loss_fn, inputs, batch)
    with record_function("vip.forward"), _Tape(plan, batch, noise.start_early, norm_helpers) as tape:
        stand_ins = _stand_ins(plan, batch)
        losses = _losses(model, loss_fn, inputs, stand_ins, batch)
    plain_rules = [PlainRule(name, param) for name, param in plan.plain]
    with full_float32(device):
        if losses.requires_grad:
            _check_parameter_uses(losses, plan, tape)
            with record_function("vip.backward"):
                wanted = [tape.anchor, *stand_ins.values()]
                grads = torch.autograd.grad(losses.sum(), wanted, allow_unused=True)
                for rule, grad in zip(plain_rules, grads[1:]):
                    rule.record_stand_in(grad)
        rules = [rule for _, rule in tape.rules] + plain_rules
        with record_function("vip.norms"):
            squared = torch.zeros(batch, device=device)
            bounds = GramBounds()
            for rule in rules:
                rule.check_kept()
                squared += rule.squared_norms(batch, device, bounds, materialised=False).to(device)
            squared += bounds.total(batch, device).float()  # the ghost norms' rounding bounds
            squared += materialised_squared_norms(_materialised(rules), batch, device)
            factors, finite = clip_factors(squared, max_grad_norm)
            if not bool(finite.all()):
                for rule in rules:
                    rule.zero_samples(finite)
        with record_function("vip.clipped_sum"):
            noise.draw_all()
            noise.settle([param for rule in rules for param in rule.params], sums)
            add_materialised_sums(_materialised(rules), factors, sums)
            for rule in rules:
                rule.check_kept()
                rule.add_clipped_sum(factors, sums, tensor_cores=tensor_core_sums, materialised=False)
    total.examples += batch
    total.loss_sum += losses.detach().float().sum()
    total.clipped += ((squared.sqrt() > max_grad_norm) & finite).sum()
    total.non_finite += (~finite).sum()


def _materialised(rules: list[Rule]) -> PerSample:
    """Every rule's materialised per-sample gradients, with their parameters."""
    return [(param, grads) for rule in rules for param, grads in rule.per_sample.items()]


@contextlib.contextmanager
def full_float32(device: torch.device) -> Iterator[None]:
    """Per-sample norms, clip factors and clipped sums in full float32 whatever the caller enclosed the step in:
    autocast off (a bfloat16 matmul in a norm or a sum lets a clipped sample exceed C) and IEEE float32 matmuls
    and convolutions (no TF32 on CUDA, no bfloat16 in oneDNN on CPUs that have it). The backward of an autocast
    forward still runs in the forward's dtypes."""
    with _ieee_float32(), torch.autocast(device.type, enabled=False):
        yield


_FP32_PRECISION_LOCK = threading.Lock()
_fp32_precision_users = 0
_saved_fp32_precisions: list[str] = []
_saved_matmul_precision: list[str] = []


def _fp32_backends() -> list[Any]:
    """The backends whose float32 matmuls or convolutions may run at reduced precision."""
    backends = torch.backends
    return [b for b in (backends.cuda.matmul, backends.cudnn.conv, backends.mkldnn.matmul, backends.mkldnn.conv)
            if hasattr(b, "fp32_precision")]


@contextlib.contextmanager
def _ieee_float32() -> Iterator[None]:
    """Sets every backend's ``fp32_precision`` to ``"ieee"``, and torch's float32 matmul precision to
    ``"highest"`` so that the legacy setting agrees (torch refuses a TF32 check when the two disagree), while any
    thread is inside (the settings are the process's): the first thread in saves them, the last one out restores
    them."""
    global _fp32_precision_users
    with _FP32_PRECISION_LOCK:
        if _fp32_precision_users == 0:
            _saved_matmul_precision[:] = [torch.get_float32_matmul_precision()]
            _saved_fp32_precisions[:] = [backend.fp32_precision for backend in _fp32_backends()]
            torch.set_float32_matmul_precision("highest")
            for backend in _fp32_backends():
                backend.fp32_precision = "ieee"
        _fp32_precision_users += 1
    try:
        yield
    finally:
        with _FP32_PRECISION_LOCK:
            _fp32_precision_users -= 1
            if _fp32_precision_users == 0:
                torch.set_float32_matmul_precision(_saved_matmul_precision[0])
                for backend, saved in zip(_fp32_backends(), _saved_fp32_precisions):
                    backend.fp32_precision = saved


def clip_factors(squared_norms: torch.Tensor, max_grad_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample scale ``min(1, C / ‖gᵢ‖)``, 0 where the norm is not finite; and the finite mask."""
    finite = torch.isfinite(squared_norms)
    factors = (max_grad_norm / (squared_norms.clamp_min(0).sqrt() + CLIP_EPS)).clamp(max=1.0)
    return torch.where(finite, factors, torch.zeros_like(factors)), finite


def _stand_ins(plan: ModelPlan, batch: int) -> dict[str, torch.Tensor]:
    """A ``[B, ...]`` stand-in per plain ``[1, ...]`` parameter: row i is sample i's copy."""
    return {name: p.detach().expand(batch, *p.shape[1:]).requires_grad_() for name, p in plan.plain}


def _verify_per_sample_layout(plan: ModelPlan, model: nn.Module, loss_fn: LossFn, inputs: Inputs, batch: int) -> None:
    """Refuses a model in which a layer's output row or a plain parameter's stand-in row reaches another
    sample's loss: the rules take row i of every hooked layer's input and output, and of every stand-in, to
    be sample i's, and a model that lays its samples out otherwise (sequence-first, a ``[1, D]`` parameter
    added to ``[B, T, D]``) would have its samples mixed, silently when the shapes happen to fit.

    Checked on a model's microbatches of two or more samples until every layer and plain parameter (by identity and
    name) was reached once, afresh for another loss_fn or other input names and dtypes: the gradients of the first
    and the last sample's loss must be exactly zero in every other sample's rows. A microbatch whose checked loss is not
    finite, or whose gradient in another sample's rows is NaN, proves nothing and is passed over. The floating-point
    and complex inputs are checked once too, in a forward of their own (:func:`_check_inputs_unmixed`).
    """
    if batch < 2:
        return
    checked = _layout_checked(model, loss_fn, inputs)
    parts: dict[str, nn.Module | nn.Parameter] = {name: param for name, param in plan.plain}
    parts.update((name, module) for name, module, _ in plan.layers)
    if all(name in checked.parts.get(part, ()) for name, part in parts.items()):
        return
    with torch.autograd.set_detect_anomaly(False):  # anomaly mode would raise on the NaN entries passed over
        reached = _check_layers_unmixed(plan, model, loss_fn, inputs, batch)
        if reached is None:
            return
        if not checked.inputs:  # after the layers' graph is freed
            checked.inputs = _check_inputs_unmixed(plan, model, loss_fn, inputs, batch)
            if not checked.inputs:
                return
    for name, count in reached.items():
        if count == len(_checked_samples(batch)):
            checked.parts.setdefault(parts[name], set()).add(name)


@dataclass
class _LayoutChecked:
    """What :func:`_verify_per_sample_layout` has checked of one model with one loss_fn and one input structure."""

    is_checked_loss: Callable[[LossFn], bool]  # whether a loss_fn is the checked one (held weakly where it can be)
    input_structure: tuple[tuple[str, torch.dtype], ...]
    modules: _ModuleTree  # the model's modules, hooks and instance forwards when the record was started
    # the layers and plain parameters checked, by identity and the names they were checked under: a layer put in a
    # checked one's place, or a checked layer moved or wrapped under another name, is checked afresh
    parts: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    inputs: bool = False  # the floating-point and complex inputs checked


def _layout_checked(model: nn.Module, loss_fn: LossFn, inputs: Inputs) -> _LayoutChecked:
    """The model's record, started afresh when the loss_fn or the inputs' names and dtypes are not the ones checked
    (another loss, or other inputs, may mix samples where the checked ones did not)."""
    structure = tuple((name, tensor.dtype) for name, tensor in _named_inputs(inputs))
    modules = list(model.named_modules(remove_duplicate=False))
    checked = _LAYOUT_CHECKED.get(model)
    if (checked is None or not checked.is_checked_loss(loss_fn) or checked.input_structure != structure
            or not checked.modules.matches(modules)):
        checked = _LayoutChecked(_recogniser(loss_fn), structure, _ModuleTree(modules))
        _LAYOUT_CHECKED[model] = checked
    return checked


class _ModuleTree:
    """A model's modules as a record was started: each module's name, object (held weakly), type and its forward,
    hooks and any forward set on the instance, and the global module hooks. A module added, replaced, moved or
    hooked, or a forward set on an instance or its class, after the check may mix samples where the checked model
    did not."""

    def __init__(self, modules: list[tuple[str, nn.Module]]) -> None:
        self.entries = [(name, weakref.ref(module), type(module), _class_forward(type(module)), _hook_state(module),
                         _forward_recogniser(module)) for name, module in modules]
        self.global_hooks = _global_hook_state()

    def matches(self, modules: list[tuple[str, nn.Module]]) -> bool:
        if len(modules) != len(self.entries) or _global_hook_state() != self.global_hooks:
            return False
        for (name, module), (checked_name, checked_module, cls, cls_forward, hooks, is_forward) in zip(
                modules, self.entries):
            if name != checked_name or checked_module() is not module or type(module) is not cls:
                return False
            if _class_forward(cls) is not cls_forward:
                return False
            forward = module.__dict__.get("forward")
            if _hook_state(module) != hooks or (forward is None) != (is_forward is None):
                return False
            if forward is not None and not is_forward(forward):
                return False
        return True


def _class_forward(cls: type) -> Any:
    """The forward a module's class defines or inherits; None where the class cannot give it (a TorchScript module's
    compiled forward)."""
    return getattr(cls, "forward", None)


_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hook_state(module: nn.Module) -> tuple | None:
    """The ids of ``module``'s hooks (handle ids, never reused), or None when it has none."""
    tables = [getattr(module, table, None) for table in _HOOK_TABLES]
    return tuple(tuple(table) for table in tables) if any(tables) else None


def _global_hook_state() -> tuple:
    """The ids of the hooks registered for every module (``register_module_forward_hook`` and the like)."""
    return tuple(tuple(getattr(nn.modules.module, f"_global{table}", ())) for table in _HOOK_TABLES)


def _forward_recogniser(module: nn.Module) -> Callable[[Callable], bool] | None:
    """Whether a later instance forward is the one set on ``module`` now (``module.forward = ...``); None when
    there is none."""
    forward = module.__dict__.get("forward")
    return None if forward is None else _recogniser(forward)


def _recogniser(loss_fn: LossFn) -> Callable[[LossFn], bool]:
    """Whether a later loss_fn is this same function object, or this method bound to this same object (each access
    makes a new bound method)."""
    if inspect.ismethod(loss_fn):
        function, owner = loss_fn.__func__, _reference(loss_fn.__self__)
        return lambda other: inspect.ismethod(other) and other.__func__ is function and other.__self__ is owner()
    held = _reference(loss_fn)
    return lambda other: other is held()


def _reference(target: Any) -> Callable[[], Any]:
    """A weak reference to ``target`` (a loss_fn or its object may hold the model, which must not be kept alive by
    its record), or a strong one where ``target`` cannot be referenced weakly (a ``__slots__`` class, a builtin):
    then a loss_fn holding its model keeps it alive for the process."""
    try:
        return weakref.ref(target)
    except TypeError:
        return lambda: target


def _check_layers_unmixed(
    plan: ModelPlan, model: nn.Module, loss_fn: LossFn, inputs: Inputs, batch: int
) -> dict[str, int] | None:
    """The layers' and stand-ins' part of :func:`_verify_per_sample_layout`: how many of the checked samples reached
    each, or None when the microbatch proves nothing (a loss not finite, a NaN in another sample's rows)."""
    stand_ins = _stand_ins(plan, batch)
    outputs: list[tuple[str, torch.Tensor]] = []
    handles = [module.register_forward_hook(_keep_output(name, outputs)) for name, module, _ in plan.layers]
    try:
        losses = _losses(model, loss_fn, inputs, stand_ins, batch)
    finally:
        for handle in handles:
            handle.remove()
    watched = [*stand_ins.items(), *outputs]
    reached = {name: 0 for name, _ in watched}
    for sample in _checked_samples(batch):
        if not _proves_something(losses[sample]):
            return None
        grads = torch.autograd.grad(losses[sample], [t for _, t in watched], retain_graph=True, allow_unused=True)
        for (name, tensor), grad in zip(watched, grads):
            if grad is None:
                continue
            others = _other_rows(grad, sample)
            if bool(others.isnan().any()):
                return None
            if bool((others != 0).any()):
                raise UnsupportedLayerError(_mixing_message(name, stand_ins, sample))
            reached[name] += 1
    return reached


def _check_inputs_unmixed(plan: ModelPlan, model: nn.Module, loss_fn: LossFn, inputs: Inputs, batch: int) -> bool:
    """Refuses a model or loss in which the first or the last sample's loss depends on another sample's rows of a
    floating-point or complex input: samples mixed before the first layer by differentiable operations
    (``x - x.mean(0)``), which the layers' rows do not show. A forward of its own, apart from the layers' check (a
    model might branch on its inputs' ``requires_grad``); NaN entries of the gradients (0 · log 0) are passed over,
    and a model or loss that cannot run on inputs that require grad (``.numpy()``, ``out=``) is not checked here
    (a warning says so). Integer inputs
    (indices, uint8 images) have no gradient to watch, and mixing through operations without a gradient (a
    detached batch mean) is not seen. False when this microbatch proves nothing (a checked loss not finite), so
    the next one is checked again."""
    watched_inputs, leaves = _watched_inputs(inputs)
    if not leaves:
        return True
    per_sample = []
    try:
        losses = _losses(model, loss_fn, watched_inputs, _stand_ins(plan, batch), batch)
        for sample in _checked_samples(batch):
            if not _proves_something(losses[sample]):
                return False
            grads = torch.autograd.grad(losses[sample], [leaf for _, leaf in leaves], retain_graph=True,
                                        allow_unused=True)
            per_sample.append((sample, grads))
    except (RuntimeError, NotImplementedError, UnsupportedLayerError) as error:  # cannot run on inputs requiring grad
        logger.warning("the per-sample layout check left this model's inputs unchecked: its forward or loss_fn "
                       "raised %s on inputs that require grad, so samples mixed before the first layer cannot be "
                       "seen (docs/privacy.md, rule 5)", type(error).__name__)
        return True
    for sample, grads in per_sample:
        for (name, _), grad in zip(leaves, grads):
            others = None if grad is None else _other_rows(grad, sample)
            if others is not None and bool(((others != 0) & ~others.isnan()).any()):
                raise UnsupportedLayerError(_input_mixing_message(name, sample))
    return True


def _checked_samples(batch: int) -> list[int]:
    """The samples whose losses the layout check differentiates: the first and the last."""
    return sorted({0, batch - 1})


def _proves_something(loss: torch.Tensor) -> bool:
    """Whether a checked sample's loss can show mixing: it has a gradient and is finite."""
    return loss.requires_grad and bool(torch.isfinite(loss))


def _other_rows(grad: torch.Tensor, sample: int) -> torch.Tensor:
    """``grad`` without ``sample``'s row: the rows of the other samples."""
    return torch.cat([grad[:sample], grad[sample + 1:]])


def _watched_inputs(inputs: Inputs) -> tuple[Inputs, list[tuple[str, torch.Tensor]]]:
    """``inputs`` with each floating-point or complex tensor replaced by a copy of a new leaf that requires grad (a
    copy, so that the model may still write into it in place), and those leaves by name (``input``, ``input[k]``)."""
    leaves: list[tuple[str, torch.Tensor]] = []

    def watched(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            return tensor
        leaf = tensor.detach().requires_grad_()
        leaves.append((name, leaf))
        return leaf.clone()

    return _map_inputs(inputs, watched), leaves


def _named_inputs(inputs: Inputs) -> list[tuple[str, torch.Tensor]]:
    """The input tensors by name (``input``, ``input[k]``), in order."""
    named: list[tuple[str, torch.Tensor]] = []
    _map_inputs(inputs, lambda name, tensor: named.append((name, tensor)))
    return named


def _map_inputs(inputs: Inputs, fn: Callable[[str, torch.Tensor], Any]) -> Any:
    """``inputs`` with ``fn(name, tensor)`` in place of each tensor, in the same structure."""
    if isinstance(inputs, torch.Tensor):
        return fn("input", inputs)
    if isinstance(inputs, Mapping):
        return {key: fn(f"input[{key!r}]", value) for key, value in inputs.items()}
    return type(inputs)(fn(f"input[{index}]", value) for index, value in enumerate(inputs))


def _keep_output(name: str, outputs: list[tuple[str, torch.Tensor]]) -> Callable:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            outputs.append((name, output))

    return hook


def _input_mixing_message(name: str, sample: int) -> str:
    return (f"sample {sample}'s loss depends on other samples' rows of {name}: the model or loss_fn mixes samples "
            "(batch statistics such as x - x.mean(0), or a loss normalised over the batch), and per-sample clipping "
            "needs each sample's loss to depend on its own inputs only")


def _mixing_message(name: str, stand_ins: dict[str, torch.Tensor], sample: int) -> str:
    if name in stand_ins:
        shape = [1, *stand_ins[name].shape[1:]]
        return (f"plain parameter '{name}' {shape} is not broadcast against the batch alone: sample {sample}'s loss "
                "reaches other samples' copies of it, so its per-sample gradient would mix samples (e.g. a [1, D] "
                "parameter added to [B, T, D]); give it shape [1, 1, D]")
    return (f"layer '{name}': sample {sample}'s loss reaches other rows of the layer's output, so dim 0 is not the "
            "sample (a sequence-first or flattened layout); per-sample clipping needs the batch on dim 0")


_LAYOUT_CHECKED: "weakref.WeakKeyDictionary[nn.Module, _LayoutChecked]" = weakref.WeakKeyDictionary()



def _losses(
    model: nn.Module, loss_fn: LossFn, inputs: Inputs, stand_ins: dict[str, torch.Tensor], batch: int
) -> torch.Tensor:
    if stand_ins:
        losses = _with_stand_ins(model, loss_fn, inputs, stand_ins)
    else:
        losses = loss_fn(model, inputs)
    if not isinstance(losses, torch.Tensor) or losses.shape != (batch,):
        shape = list(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(f"loss_fn must return one loss per sample, shape [{batch}], got {shape}")
    return losses


def _with_stand_ins(model: nn.Module, loss_fn: LossFn, inputs: Inputs, stand_ins: dict[str, torch.Tensor]) -> torch.Tensor:
    """The losses with each plain parameter replaced by its stand-in; a broadcast that fails is refused by name.

    Only the parameter's own entry is swapped (``tie_weights=False``: looking for other names of the same tensor walks
    every parameter and buffer of the model, each microbatch). :func:`plan_model` refuses a parameter registered twice
    and a supported layer computing with another's parameter (a weight that is a buffer or attribute holding it);
    one reaching the loss otherwise (a buffer holding the same tensor) does so outside its stand-in, which
    :func:`_check_parameter_uses` refuses by name."""
    swapped = {f"model.{k}": v for k, v in stand_ins.items()}
    try:
        return functional_call(_LossCall(model, loss_fn), swapped, (inputs,), tie_weights=False)
    except RuntimeError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnsupportedLayerError(
            f"the model fails when its plain parameters ({', '.join(stand_ins)}) are given one copy per sample "
            f"([B, ...]): {reason}. A [1, ...] parameter must be broadcast against the batch dimension only"
        ) from error


class _LossCall(nn.Module):
    """``loss_fn(model, inputs)`` as a module, so ``functional_call`` can swap in the stand-ins."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: Inputs) -> torch.Tensor:
        return self.loss_fn(self.model, inputs)


def _check_parameter_uses(losses: torch.Tensor, plan: ModelPlan, tape: _Tape) -> None:
    """Each hooked parameter must reach the loss once per call of its layer that reaches the loss, and
    nowhere else; a plain parameter only through its stand-in. Otherwise a gradient would escape clipping."""
    names = {param: rule.name for _, rule in tape.rules for param in rule.params}
    names.update({param: name for name, param in plan.plain})
    uses, calls_reached = _parameter_uses(losses.grad_fn, set(names))
    expected = {param: calls_reached[module] for module, rule in tape.rules for param in rule.params}
    # a plain parameter reaches the loss through its stand-in alone
    expected.update({param: 0 for _, param in plan.plain})
    for param, name in names.items():
        calls = expected.get(param, 0)
        if uses[param] != calls:
            raise UnsupportedLayerError(
                f"a parameter of '{name}' reaches the loss {uses[param]} time(s) but its layer ran {calls} "
                "time(s): it is used outside the layer's own forward (tied or functional use), which cannot "
                "be clipped per sample"
            )


def _parameter_uses(root: Any, params: set[nn.Parameter]) -> tuple[Counter, Counter]:
    """From ``root``: how many autograd edges lead into each of ``params`` (through autocast casts), and
    how many captured calls of each layer are reached."""
    uses: Counter[nn.Parameter] = Counter()
    calls: Counter[nn.Module] = Counter()
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        layer = getattr(node, "layer", None)
        if layer is not None:
            calls[layer] += 1
        for child, _ in node.next_functions:
            if child is None:
                continue
            param = _leaf_param(child)
            if param is not None:
                if param in params:
                    uses[param] += 1
                continue
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return uses, calls


def _leaf_param(node: Any) -> torch.Tensor | None:
    """The parameter behind an AccumulateGrad node, or behind an autocast cast of one; else None."""
    variable = getattr(node, "variable", None)
    if variable is not None:
        return variable
    if node.name() in _CAST_NODES and len(node.next_functions) == 1:
        (inner, _), = node.next_functions
        return getattr(inner, "variable", None) if inner is not None else None
    return None
