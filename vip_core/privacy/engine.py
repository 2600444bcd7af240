"""The privatized gradient: per-sample clipping over all parameters, Gaussian noise, division by the
expected batch size.

A :class:`DPEngine` is planned once per model; each logical batch is one :class:`ClippedGradientSum`, which sets
each trainable parameter's ``.grad`` to

    (Σᵢ clip(gᵢ, C) + N(0, σ²C²I)) / expected_batch_size

where ``gᵢ`` is sample i's gradient over *all* trainable parameters (flat clipping), the noise is drawn once per
logical batch (never per microbatch) and the divisor is the public expected batch size, never the realised count.
:func:`privatized_gradients` is the one-call form.

How it is fast (book-keeping): one forward, then one backward that asks autograd only for activation gradients,
so no layer computes its weight gradient. A wrapper of each supported layer's forward keeps its input ``A`` (cast
to the autocast dtype first, the very operand the layer multiplies) in the layer's
:class:`~vip_core.privacy.per_sample.Record`, and the autograd edge of its output, at which the backward is asked
for the output gradient ``G``. Layers of one shape are then computed together (:mod:`vip_core.privacy.per_sample`):
per-sample squared norms with their rounding bounds, clip factors under the error model of
:mod:`vip_core.privacy.numerics`, and the clipped sums, added into the noise already drawn in a flat buffer
(:mod:`vip_core.privacy.buffer`). Plain parameters of shape ``[1, ...]`` (cls/mask tokens, learnt position
embeddings) are replaced during the forward by a per-sample stand-in ``[B, ...]`` whose gradient is per sample. Each
microbatch is padded to the physical batch size with copies of its first sample whose losses are weighted 0 (their
gradients are exactly 0, and their clip factors 0), so that every microbatch has the same shapes.

What is refused, once, with an error naming the layer (:func:`plan_model`, :mod:`vip_core.privacy.layout`): a
trainable parameter of any other layer type, a plain parameter whose leading dimension is not 1, batch
normalisation in training mode, a buffer the training forward changes, a parameter shared between layers or used
outside its layer's forward (tied weights), an ``Embedding`` with ``scale_grad_by_freq`` or ``sparse``, a layer
whose input or output does not have the microbatch on dim 0, a model that mixes samples (a sequence-first layout,
batch statistics of the inputs), and a layer input modified in place after the layer ran.
"""

from __future__ import annotations

import contextlib
import functools
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.profiler import record_function

from vip_core.privacy import numerics, per_sample
from vip_core.privacy.buffer import GradientBuffer, StepNoise, idle_cores, noise_pool
from vip_core.privacy.layout import (
    Inputs, LayoutCheck, LossFn, UnsupportedLayerError, WriteGuard, edge_gradients, output_edge, per_sample_losses,
    stand_ins, wrapped_forwards,
)
from vip_core.privacy.numerics import Numerics
from vip_core.privacy.per_sample import Layer, Norms, Record
from vip_core.privacy.randomness import GaussianDraw, RandomStream

__all__ = ["ClippedGradientSum", "DPEngine", "Inputs", "LossFn", "ModelPlan", "StepStats", "UnsupportedLayerError",
           "plan_model", "privatized_gradients", "split_batch"]

# Subclasses whose own forward computes exactly their base layer's function of (input, weight, bias).
EQUIVALENT_SUBCLASSES = frozenset({"timm.layers.norm.LayerNorm", "timm.layers.linear.Linear"})
KINDS = {nn.Linear: "matmul", nn.Conv2d: "matmul", nn.LayerNorm: "layer_norm", nn.Embedding: "embedding"}
_CASTS = (nn.Linear, nn.Conv2d)  # the layers autocast runs in its lower precision
SPREAD_MIN_WORK = 1 << 22  # the fewest multiply-adds worth a helper thread (about 0.1 ms of one core)
EARLY_MIN_ELEMENTS = 1 << 18  # the fewest elements a cluster keeps to be worth following through the backward


@dataclass(frozen=True)
class StepStats:
    """What one logical batch saw. Data-dependent and NOT privatized: for monitoring only, never to release.

    Attributes:
        examples: the realised number of examples.
        loss_sum: the sum of their losses.
        clipped: how many had a clip factor below 1.
        non_finite: how many had a non-finite gradient (they contribute nothing).
        shortfall: the clipped samples' mean of ``1 − f·N/C`` (``N`` the computed norm): how much the rounding
            bounds and margins scaled them below ``C``.
    """

    examples: int
    loss_sum: float
    clipped: int
    non_finite: int
    shortfall: float


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
    strict_float32: bool = False,
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
        physical_batch_size: microbatch size bounding memory (microbatches are padded to it); the whole batch at
            once when None.
        noise: the random stream of the noise; required when ``noise_multiplier`` > 0.
        strict_float32: IEEE float32 norms and clipped sums (:mod:`vip_core.privacy.numerics`).

    Returns:
        Monitoring statistics of the batch (not private).
    """
    engine = DPEngine(model, max_grad_norm=max_grad_norm, strict_float32=strict_float32)
    clipped = engine.clipped_sum(noise_multiplier=noise_multiplier, noise=noise)
    clipped.add(loss_fn, inputs, physical_batch_size=physical_batch_size)
    return clipped.privatize(expected_batch_size=expected_batch_size)


class DPEngine:
    """Per-sample clipping of one model, planned once: which rule covers which parameter, the gradient buffer, each
    device's numerics, and what is left of the one-time layout check.

    Args:
        model: the model (see :func:`privatized_gradients` for what it may contain).
        max_grad_norm: the clipping bound C.
        strict_float32: IEEE float32 norms and clipped sums instead of the device's matrix units.
    """

    def __init__(self, model: nn.Module, *, max_grad_norm: float, strict_float32: bool = False) -> None:
        _check_arguments(max_grad_norm, 0.0, 1.0, None)
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.strict = strict_float32
        self.numerics: dict[torch.device, Numerics] = {}
        self.current: ClippedGradientSum | None = None
        self.masks: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self._plan()

    def _plan(self) -> None:
        """Plans the model as it is now: its rules, gradient buffer, layout check and write guard."""
        model = self.model
        self.plan = plan_model(model)
        self.buffer = GradientBuffer(self.plan.params)
        self.layout = LayoutCheck([(layer.name, layer.module) for layer in self.plan.layers], self.plan.plain)
        self.guard = WriteGuard(model)
        self.uses = {param: (layer.name, layer.module) for layer in self.plan.layers for param in layer.params}
        self.uses.update({param: (name, None) for name, param in self.plan.plain})

    def clipped_sum(self, *, noise_multiplier: float = 0.0, noise: RandomStream | None = None) -> ClippedGradientSum:
        """A new logical batch's sum, its noise drawn into the buffer (a sum not privatized yet is given up). A model
        whose parameters were frozen or unfrozen since it was planned is planned again."""
        if self.guard.moved():
            self._plan()  # a module or parameter replaced, frozen, unfrozen, or moved since
        for name, module in self.plan.batch_norms:
            _reject_batch_norm(name, module)  # a model may be put in training mode after it was planned
        if self.current is not None:
            self.current.noise.stop()
            self.current.close("was given up for a newer sum of the same engine")
        self.current = ClippedGradientSum(self, noise_multiplier, noise)
        return self.current

    def device_numerics(self, device: torch.device) -> Numerics:
        if device not in self.numerics:
            self.numerics[device] = numerics.numerics_for(device, strict=self.strict)
        return self.numerics[device]

    def real_rows(self, batch: int, real: int, device: torch.device) -> torch.Tensor:
        """``[batch]`` bool, True for the first ``real`` rows (a padded microbatch's own samples)."""
        key = (batch, real, device)
        if key not in self.masks:
            self.masks[key] = torch.arange(batch, device=device) < real
        return self.masks[key]


_FAILED = "failed part-way: its sums hold part of a batch, so it cannot go on"


class ClippedGradientSum:
    """The running sum Σᵢ clip(gᵢ, C) over any number of microbatches of one logical batch, plus the noise once
    (:meth:`DPEngine.clipped_sum` makes one). After :meth:`privatize`, or after a call that failed part-way, it
    refuses to go on: its sums hold a whole or a part of a batch against noise sized for once."""

    def __init__(self, engine: DPEngine, noise_multiplier: float, noise: RandomStream | None) -> None:
        _check_arguments(engine.max_grad_norm, noise_multiplier, 1.0, None)
        if noise_multiplier > 0 and noise is None:
            raise ValueError("noise_multiplier > 0 needs a noise stream (a RandomStream), never a default generator")
        self.engine = engine
        self.buffer = engine.buffer  # this sum's, also where the engine plans the model again and makes another
        for param in (*engine.plan.params, *engine.plan.frozen):
            # a trainable parameter's gradient is a view of the buffer, which now takes noise and sums not yet
            # privatized; a frozen one's stale gradient would be applied by the optimiser
            param.grad = None
        draw = GaussianDraw(noise, noise_multiplier * engine.max_grad_norm) if noise_multiplier > 0 else None
        self.noise = StepNoise(self.buffer, draw)
        self.totals = _Totals()
        self.closed: str | None = None
        self.adding = False  # True while add() runs, and after an add() that did not return

    def add(self, loss_fn: LossFn, inputs: Inputs, *, physical_batch_size: int | None = None) -> None:
        """Adds the clipped per-sample gradients of ``inputs``, in microbatches of ``physical_batch_size`` (each
        padded to that size)."""
        self._check_open()
        _check_arguments(self.engine.max_grad_norm, 0.0, 1.0, physical_batch_size)
        self.adding = True  # a call that fails refuses the sum even where a second Ctrl-C stops it closing
        with self._closed_on_error():
            for chunk, real in padded_microbatches(inputs, physical_batch_size):
                _add_microbatch(self.engine, loss_fn, chunk, real, self)
            self.engine.guard.check_structure()
        self.adding = False

    def privatize(self, *, expected_batch_size: float,
                  all_reduce: Callable[[torch.Tensor], None] | None = None) -> StepStats:
        """Sets each trainable parameter's ``.grad`` to (sum + N(0, σ²C²I)) / expected_batch_size.

        Args:
            expected_batch_size: the public divisor q·N.
            all_reduce: sums a flat gradient tensor over the workers in place (data-parallel training).

        Returns:
            Monitoring statistics of the batch (not private).
        """
        _check_arguments(self.engine.max_grad_norm, 0.0, expected_batch_size, None)
        self._check_open()
        self.close("was privatized already: its noise is spent, so it cannot sum or privatize another batch")
        self.noise.wait()
        self.buffer.set_gradients(expected_batch_size, all_reduce)
        return self.totals.stats()

    def close(self, reason: str) -> None:
        with self.buffer.lock:  # once set, a helper's sum still running adds nothing (see add_rows)
            self.closed = reason
        if self.engine.current is self:
            self.engine.current = None

    def add_rows(self, params: list[nn.Parameter], values: torch.Tensor) -> None:
        """:meth:`GradientBuffer.add_rows`, while this sum is open: a helper's sum left running by a step that failed
        (a Ctrl-C can come anywhere, a wait for the helpers included) must not add into the buffer once it holds
        another sum's noise."""
        with self.buffer.lock:
            if self.closed is None:
                self.buffer.add_rows(params, values)

    def _check_open(self) -> None:
        reason = self.closed or (_FAILED if self.adding else None)
        if reason is not None:
            raise RuntimeError(f"this ClippedGradientSum {reason}; create one per logical batch")

    def discard(self) -> None:
        """Gives the sum up (a step that failed): closed, its noise stopped and the buffer zeroed, since gradients
        kept from an earlier step may be views of the buffer, which holds noise and sums not privatized."""
        self.close(_FAILED)
        self.noise.stop()
        with self.buffer.lock:
            for flat in self.buffer.flats.values():
                flat.zero_()

    @contextlib.contextmanager
    def _closed_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.discard()
            raise


def _check_arguments(max_grad_norm: float, noise_multiplier: float, expected_batch_size: float,
                     physical_batch_size: int | None) -> None:
    if not 0 < max_grad_norm < float("inf"):  # an infinite C would clip nothing
        raise ValueError(f"max_grad_norm must be finite and > 0, got {max_grad_norm}")
    if not 0 <= noise_multiplier < float("inf"):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier}")
    if not expected_batch_size > 0:
        raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size}")
    if physical_batch_size is not None and physical_batch_size <= 0:
        raise ValueError(f"physical_batch_size must be > 0, got {physical_batch_size}")


class _Totals:
    """Running statistics, kept on the device until :meth:`stats` (no sync per microbatch)."""

    def __init__(self) -> None:
        self.examples = 0
        self.sums: list[torch.Tensor] = []  # [loss sum, clipped, non-finite, shortfall sum] per microbatch

    def add(self, real: int, losses: torch.Tensor, factors: torch.Tensor, realness: torch.Tensor,
            computed: torch.Tensor, max_grad_norm: float) -> None:
        """One microbatch's statistics: ``factors`` its clip factors (0 for padding and dropped samples), ``computed``
        its computed squared norms."""
        kept = factors > 0
        clipped = kept & (factors < numerics.FACTOR_ROUNDING)  # an unclipped sample's factor is 1, rounded down
        shortfall = torch.where(clipped, 1 - factors.double() * computed.sqrt() / max_grad_norm, 0.0)
        self.examples += real
        self.sums.append(torch.stack([torch.where(realness, losses.detach().double(), 0.0).sum(),
                                      clipped.sum().double(), (realness & ~kept).sum().double(), shortfall.sum()]))

    def stats(self) -> StepStats:
        loss_sum, clipped, non_finite, shortfall = torch.stack(self.sums).sum(0).tolist() if self.sums else [0.0] * 4
        return StepStats(self.examples, loss_sum, int(clipped), int(non_finite), shortfall / max(clipped, 1.0))


# ------------------------------------------------------------------------------------------------ planning


@dataclass
class ModelPlan:
    """Which rule covers which trainable parameter.

    Attributes:
        layers: each supported layer with trainable parameters.
        plain: ``(qualified parameter name, parameter)`` for each plain parameter.
        params: every trainable parameter, in ``model.named_parameters()`` order.
        frozen: the parameters that are not trainable (their gradients are dropped each step).
        batch_norms: the batch normalisation layers (refused whenever they are in training mode).
    """

    layers: list[Layer]
    plain: list[tuple[str, nn.Parameter]]
    params: list[nn.Parameter]
    frozen: list[nn.Parameter]
    batch_norms: list[tuple[str, nn.Module]]


def plan_model(model: nn.Module) -> ModelPlan:
    """Assigns every trainable parameter of ``model`` to a rule, or raises naming what cannot be handled.

    Raises:
        UnsupportedLayerError: for a layer or parameter the engine cannot clip per sample.
    """
    layers: list[Layer] = []
    plain: list[tuple[str, nn.Parameter]] = []
    owners: dict[int, str] = {}
    for module_name, module in model.named_modules():
        _reject_batch_norm(module_name, module)
        own = [(name, p) for name, p in module.named_parameters(recurse=False) if p.requires_grad]
        for param_name, param in own:
            qualified = f"{module_name}.{param_name}" if module_name else param_name
            if id(param) in owners:
                raise UnsupportedLayerError(f"parameter '{qualified}' is the same tensor as '{owners[id(param)]}': "
                                            "shared (tied) parameters cannot be clipped per sample")
            owners[id(param)] = qualified
        if not own:
            continue
        kind = _supported_kind(module_name, module)
        if kind is not None and {name for name, _ in own} <= {"weight", "bias"}:
            weight, bias = (getattr(module, name, None) for name in ("weight", "bias"))
            layers.append(Layer(module_name, module, kind, _trainable(weight), _trainable(bias)))
            continue
        for param_name, param in own:
            qualified = f"{module_name}.{param_name}" if module_name else param_name
            _check_plain(qualified, module_name, module, param)
            plain.append((qualified, param))
    params = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    batch_norms = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return ModelPlan(layers, plain, params, frozen, batch_norms)


def _trainable(param: nn.Parameter | None) -> nn.Parameter | None:
    return param if param is not None and param.requires_grad else None


def _reject_batch_norm(name: str, module: nn.Module) -> None:
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
        raise UnsupportedLayerError(
            f"layer '{name or 'model'}' ({type(module).__name__}) mixes the samples of a batch in training "
            "mode, which per-sample clipping cannot bound: use LayerNorm or GroupNorm"
        )


def _supported_kind(name: str, module: nn.Module) -> str | None:
    """The rule kind of a supported layer whose forward is the stock one (or a known equivalent)."""
    for layer_type, kind in KINDS.items():
        cls = type(module)
        if isinstance(module, layer_type) and (cls.forward is layer_type.forward
                                               or f"{cls.__module__}.{cls.__qualname__}" in EQUIVALENT_SUBCLASSES):
            if isinstance(module, nn.Embedding) and (module.scale_grad_by_freq or module.sparse
                                                     or module.max_norm is not None):
                raise UnsupportedLayerError(
                    f"layer '{name}' (Embedding): scale_grad_by_freq, sparse gradients and max_norm (which writes the "
                    "looked-up rows into the weight) are not supported"
                )
            return kind
    return None


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


def _map(inputs: Inputs, fn: Callable[[torch.Tensor], torch.Tensor]) -> Inputs:
    if isinstance(inputs, torch.Tensor):
        return fn(inputs)
    if isinstance(inputs, Mapping):
        return {key: fn(value) for key, value in inputs.items()}
    return type(inputs)(fn(value) for value in inputs)


def split_batch(inputs: Inputs, physical_batch_size: int | None) -> Iterator[Inputs]:
    """Yields consecutive microbatches of at most ``physical_batch_size`` samples (nothing when empty)."""
    size = batch_size_of(inputs)
    step = physical_batch_size or max(size, 1)
    for start in range(0, size, step):
        yield _map(inputs, lambda t: t[start:start + step])


def padded_microbatches(inputs: Inputs, physical_batch_size: int | None) -> Iterator[tuple[Inputs, int]]:
    """Yields ``(microbatch, real)``: consecutive microbatches of ``physical_batch_size`` samples, the last padded to
    that size with copies of its first sample (``real`` of its rows are the batch's own); unpadded when None."""
    for chunk in split_batch(inputs, physical_batch_size):
        real = batch_size_of(chunk)
        missing = (physical_batch_size or real) - real
        if missing:
            chunk = _map(chunk, lambda t: torch.cat([t, t[:1].expand(missing, *t.shape[1:])]))
        yield chunk, real


# ------------------------------------------------------------------------------------------------ one microbatch


class _Tape:
    """The supported layers' forwards wrapped for one microbatch (:func:`~vip_core.privacy.layout.wrapped_forwards`):
    under autocast a Linear's or Conv2d's float32 input is cast to the autocast dtype first (as autocast would: the
    layer's own operand, kept instead of a float32 copy), and each call's input is kept with its version, and the
    autograd edge of its output, at which the backward is asked for the output gradient."""

    def __init__(self, layers: list[Layer], batch: int) -> None:
        self.batch = batch
        self.records = {layer.module: Record(layer) for layer in layers}
        self.calls: list[tuple[Record, int, GradientEdge]] = []  # each kept call's record, index and output edge
        self.sizes: dict[Record, int] = {}  # each record's kept inputs' and output gradients' elements

    def wrapped(self) -> contextlib.AbstractContextManager:
        return wrapped_forwards(self.records, self._call)

    def _call(self, module: nn.Module, forward: Callable, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(module, _CASTS):
            args, kwargs = _cast_input(args, kwargs)
        return self._keep(self.records[module], args, kwargs, forward(*args, **kwargs))

    def _keep(self, record: Record, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            raise UnsupportedLayerError(
                f"layer '{record.layer.name}' ran without autograd, or during the backward (reentrant activation "
                "checkpointing), while its parameters are trainable: they would be trained on noise alone; freeze "
                "them (requires_grad=False), or use torch.utils.checkpoint with use_reentrant=False")
        if not output.requires_grad:
            return output
        layer_input = (args[0] if args else kwargs["input"]).detach()
        if layer_input.shape[0] != self.batch or output.shape[0] != self.batch:
            raise UnsupportedLayerError(
                f"layer '{record.layer.name}' ran on an input of {layer_input.shape[0]} rows (output "
                f"{output.shape[0]}) in a microbatch of {self.batch} samples: per-sample clipping needs the batch "
                "on dim 0")
        output, edge = output_edge(output)
        self.calls.append((record, len(record.inputs), edge))
        self.sizes[record] = self.sizes.get(record, 0) + layer_input.numel() + output.numel()
        record.inputs.append(layer_input)
        record.versions.append(layer_input._version)
        record.grads.append(None)
        return output

    def layers_of_nodes(self) -> dict[Any, nn.Module]:
        """Each kept call's output node, with its layer module (for the parameter-use check)."""
        return {edge.node: record.layer.module for record, _, edge in self.calls}

    def backward(self, weighted: torch.Tensor, stand_ins: list[torch.Tensor],
                 early: "_EarlyGroups | None") -> list[torch.Tensor | None]:
        """Gives each record its output gradients (``early``, where set, hears of each as it arrives and may take
        records over); returns the stand-ins' gradients."""
        def arrived(index: int, grad: torch.Tensor | None) -> None:
            record, call, _ = self.calls[index]
            record.grads[call] = grad
            early.arrived(record)

        grads, at_stand_ins = edge_gradients(weighted, [edge for _, _, edge in self.calls], stand_ins,
                                             arrived=arrived if early is not None else None)
        taken = early.taken if early is not None else set()
        for (record, call, _), grad in zip(self.calls, grads):
            if record not in taken:
                record.grads[call] = grad
        return at_stand_ins


def _cast_input(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A Linear's or Conv2d's arguments with a float32 input cast to the autocast dtype, where autocast is on."""
    layer_input = args[0] if args else kwargs.get("input")
    if not (torch.is_grad_enabled() and isinstance(layer_input, torch.Tensor)
            and layer_input.dtype == torch.float32):
        return args, kwargs
    if (layer_input.is_cpu or layer_input.is_cuda) and not torch._C._is_any_autocast_enabled():
        return args, kwargs  # one fast test of every device's autocast, which covers these two (not MPS)
    cast = _autocast_dtype(layer_input.device)
    if cast is None:
        return args, kwargs
    if args:
        return (layer_input.to(cast), *args[1:]), kwargs
    return args, {**kwargs, "input": layer_input.to(cast)}


class _EarlyGroups:
    """On a CPU whose torch threads leave as many cores idle as they use and whose float32 matmuls are IEEE, the
    layers of one shape are handed to a helper thread as soon as the backward has delivered their last output
    gradient, so that their norms run beside the rest of the backward (a ViT's decoder blocks beside its encoder's).
    Which layers go together is a guess from the forward's shapes; the helper groups them by their actual keys, as
    the step's own thread would. Clusters too small to be worth a helper (by the sizes the forward kept) stay with
    the step's thread, and are not followed through the backward."""

    def __init__(self, engine: "DPEngine", tape: _Tape, batch: int, add_rows: per_sample.AddRows) -> None:
        self.engine, self.batch, self.add_rows = engine, batch, add_rows
        self.cluster: dict[Record, tuple] = {}
        if sum(tape.sizes.values()) >= EARLY_MIN_ELEMENTS:  # else no cluster can be worth a helper
            keys = {record: _early_key(record) for record in tape.sizes}
            totals: dict[tuple, int] = {}
            for record, key in keys.items():
                totals[key] = totals.get(key, 0) + tape.sizes[record]
            self.cluster = {record: key for record, key in keys.items() if totals[key] >= EARLY_MIN_ELEMENTS}
        self.members: dict[tuple, list[Record]] = {}
        for record, key in self.cluster.items():
            self.members.setdefault(key, []).append(record)
        self.waiting = {key: sum(len(r.inputs) for r in members) for key, members in self.members.items()}
        self.handed: list[Future] = []  # each handed cluster's norms and sums, in the order handed over
        self.taken: set[Record] = set()  # the records handed over (the step's own thread leaves them alone)

    def arrived(self, record: Record) -> None:
        """One output gradient of ``record`` has arrived; hands its cluster over once all of them have."""
        key = self.cluster.get(record)
        if key is None:
            return
        self.waiting[key] -= 1
        if self.waiting[key]:
            return
        members = self.members[key]
        for record in members:
            _own_copies(record)
        self.taken.update(members)
        task = functools.partial(_computed, self.engine, members, self.batch, members[0].inputs[0].device,
                                 self.add_rows)
        self.handed.append(noise_pool(idle_cores()).submit(_in_ieee_float32, task))

    def results(self) -> list[tuple[Norms, list[per_sample.Work]]]:
        """Each handed cluster's norms and sums, in the order they were handed over (waits for them)."""
        return [future.result() for future in self.handed]


def _own_copies(record: Record) -> None:
    """Checks ``record``'s inputs and gives it copies of them and of its gradients, taken now: the rest of the
    backward may still write into the originals (a custom autograd Function into a gradient it shares with the
    layer, through ``.data`` too), and the helper's norms and sums must both come from one value."""
    _check_unchanged(record)
    record.inputs = [x.clone() for x in record.inputs]
    record.grads = [None if g is None else g.clone() for g in record.grads]
    record.versions = [x._version for x in record.inputs]


def _early_key(record: Record) -> tuple:
    """Records with equal keys are handed over together: the layer's kind and parameter shapes, each call's input
    shape and dtype."""
    calls = tuple((tuple(x.shape), x.dtype) for x in record.inputs)
    return (record.layer.kind, calls, *per_sample.layer_shapes(record.layer))


def _helpers_have_cores(device: torch.device) -> bool:
    """Whether the step runs on a CPU whose torch threads leave as many cores idle as they use (helper threads on
    them would not slow the step's own matmuls)."""
    return device.type == "cpu" and idle_cores() >= torch.get_num_threads()


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The 16-bit dtype autocast runs Linear and Conv2d layers in on ``device``, or None."""
    if not torch.is_autocast_enabled(device.type):
        return None
    dtype = torch.get_autocast_dtype(device.type)
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def _add_microbatch(engine: DPEngine, loss_fn: LossFn, inputs: Inputs, real: int, total: ClippedGradientSum) -> None:
    """Adds the clipped per-sample gradients of one microbatch (``real`` of its rows the batch's own) to the
    buffer. On a CPU, a microbatch in which any row is not finite is computed again one sample at a time: oneDNN's
    bfloat16 matmuls can spread a NaN row into the rows beside it, which would drop other samples for one sample's
    data. A GPU's kernels keep rows apart, and reading the flag there would stall the host on the device."""
    plan, model = engine.plan, engine.model
    batch = batch_size_of(inputs)
    device = plan.params[0].device if plan.params else torch.device("cpu")
    before = engine.guard.snapshot()
    if not engine.layout.done:
        engine.layout.check(model, loss_fn, _map(inputs, lambda t: t[:real]), real)
    tape = _Tape(plan.layers, batch)
    with record_function("vip.forward"), tape.wrapped():
        swapped = stand_ins(plan.plain, batch)
        losses = per_sample_losses(model, loss_fn, inputs, swapped, batch)
    engine.layout.check_uses(losses, engine.uses, tape.layers_of_nodes)
    realness = engine.real_rows(batch, real, device)
    plain_grads: tuple = (None,) * len(swapped)
    early = None
    if losses.requires_grad:
        # the helper's IEEE float32 settings are the process's: only where they are so already may it run beside
        # the backward, whose precision is the user's
        if _helpers_have_cores(device) and numerics.cpu_float32_is_ieee():
            early = _EarlyGroups(engine, tape, batch, total.add_rows)
            early = early if early.cluster else None
        with record_function("vip.backward"):
            weighted = losses.sum() if real == batch else torch.where(realness, losses, 0.0).sum()
            plain_grads = tuple(tape.backward(weighted, list(swapped.values()), early))
    engine.guard.check(before)
    with numerics.ieee_float32():
        norms = Norms(batch, device)
        with record_function("vip.norms"):
            sums = _group_norms(engine, tape, early, zip(plan.plain, plain_grads), norms, total.add_rows)
            factors, non_finite = numerics.clip_factors(norms.values, engine.max_grad_norm, realness)
            # clearing non-finite entries is a pass over every operand: a CPU reads the flag for free, a GPU would
            # wait for it, so it always clears
            sanitize = device.type != "cpu" or bool(non_finite)
        apart = device.type == "cpu" and sanitize and batch > 1
        if not apart:
            with record_function("vip.clipped_sum"):
                total.noise.wait()
                _spread([(weight, functools.partial(add, factors, sanitize)) for weight, add in sums], device)
    if apart:
        del sums  # this microbatch's stacks, none of them added
        for sample in range(real):
            _add_microbatch(engine, loss_fn, _map(inputs, lambda t, i=sample: t[i:i + 1]), 1, total)
        return
    total.totals.add(real, losses, factors, realness, norms.values[0], engine.max_grad_norm)


def _group_norms(engine: DPEngine, tape: _Tape, early: "_EarlyGroups | None", plain: Any, norms: Norms,
                 add_rows: per_sample.AddRows) -> list[per_sample.Work]:
    """Every layer's and plain parameter's norms added to ``norms``, layers of one shape together; their sums, which
    add through ``add_rows``."""
    taken = early.taken if early is not None else set()
    records = [record for record in tape.records.values() if record not in taken]
    work, sums = _layer_tasks(engine, records, norms, add_rows)
    plain = [(param, grads) for (_, param), grads in plain if grads is not None]
    work += [(grads.numel(), functools.partial(_plain, param, grads, add_rows)) for param, grads in plain]
    computed = _spread(work, norms.values.device)
    for early_norms, early_sums in early.results() if early is not None else []:
        norms.merge(early_norms)
        sums += early_sums
    sums += _merged(norms, computed)
    norms.fold_squares()
    return sums


def _merged(norms: Norms, computed: list[tuple[Norms, list[per_sample.Work]]]) -> list[per_sample.Work]:
    """Each computed group's norms merged into ``norms``; their sums."""
    sums = []
    for group_norms, group_sums in computed:
        norms.merge(group_norms)
        sums += group_sums
    return sums


def _computed(engine: DPEngine, records: list[Record], batch: int, device: torch.device,
              add_rows: per_sample.AddRows) -> tuple[Norms, list[per_sample.Work]]:
    """The norms (an accumulator of their own) and sums of ``records``' layers, all on this thread."""
    norms = Norms(batch, device)
    work, sums = _layer_tasks(engine, records, norms, add_rows)
    return norms, sums + _merged(norms, [task() for _, task in work])


def _layer_tasks(engine: DPEngine, records: list[Record], norms: Norms,
                 add_rows: per_sample.AddRows) -> tuple[list[tuple[int, Callable[[], Any]]], list[per_sample.Work]]:
    """``records``' layers grouped by shape: each group's task with the multiply-adds of its norms, and the
    embeddings' sums (their norms added to ``norms`` at once)."""
    groups: dict[tuple, tuple[list[Layer], list[torch.Tensor], list[torch.Tensor]]] = {}
    sums: list[per_sample.Work] = []
    for record in records:
        _check_unchanged(record)
        calls = [(x, g) for x, g in zip(record.inputs, record.grads) if g is not None]
        record.inputs, record.grads = [], []  # the groups hold them now, and let them go once stacked
        if not calls:
            continue  # not reached by the loss: its per-sample gradients are 0
        layer = record.layer
        if layer.kind == "embedding":
            sums += per_sample.embedding(layer, [x for x, _ in calls], [g for _, g in calls], norms, add_rows)
            continue
        if layer.kind == "matmul":
            numbers = engine.device_numerics(calls[0][0].device)
            parts = [per_sample.matmul_tokens(layer, x, g) for x, g in calls]
            first = _joined([numbers.operand(a) for a, _ in parts], 2)
            second = _joined([numbers.operand(g) for _, g in parts], 2)
            key = per_sample.matmul_key(layer, first, second)
        else:
            parts = [per_sample.layer_norm_tokens(layer, x, g) for x, g in calls]
            first, second = _joined([x for x, _ in parts], 1), _joined([g for _, g in parts], 1)
            key = per_sample.layer_norm_key(layer, first, second)
        members = groups.setdefault(key, ([], [], []))
        for target, value in zip(members, (layer, first, second)):
            target.append(value)
    work = [(_norms_work(key, firsts, seconds),
             functools.partial(_group, engine, key, layers, firsts, seconds, add_rows))
            for key, (layers, firsts, seconds) in groups.items()]
    return work, sums


def _norms_work(key: tuple, firsts: list[torch.Tensor], seconds: list[torch.Tensor]) -> int:
    """The multiply-adds of a group's norms (a LayerNorm's few operations an element counted as one)."""
    if key[0] == "matmul":
        return per_sample.matmul_norms_work(firsts, seconds)
    return sum(t.numel() for t in (*firsts, *seconds))


def _check_unchanged(record: Record) -> None:
    """Refuses a kept input of a call the loss reached that was modified in place after its layer ran (it is no
    longer what the layer multiplied)."""
    if any(x._version != version for x, version, g in zip(record.inputs, record.versions, record.grads)
           if g is not None):
        raise RuntimeError(f"the input of layer '{record.layer.name}' was modified in place after the layer ran; "
                           "per-sample gradients need it unchanged")


def _group(engine: DPEngine, key: tuple, layers: list[Layer], firsts: list[torch.Tensor],
           seconds: list[torch.Tensor], add_rows: per_sample.AddRows) -> tuple[Norms, list[per_sample.Sum]]:
    """One group's norms (an accumulator of its own) and sums."""
    norms = Norms(firsts[0].shape[0], firsts[0].device)
    if key[0] == "matmul":
        numbers = engine.device_numerics(firsts[0].device)
        return norms, per_sample.matmul_group(layers, firsts, seconds, numbers, norms, add_rows)
    return norms, per_sample.layer_norm_group(layers, firsts, seconds, norms, add_rows)


def _plain(param: nn.Parameter, grads: torch.Tensor,
           add_rows: per_sample.AddRows) -> tuple[Norms, list[per_sample.Work]]:
    """A plain parameter's norms and sum, from its stand-in's gradient ``[B, *shape[1:]]``."""
    norms = Norms(grads.shape[0], grads.device)
    values = grads.float().reshape(1, grads.shape[0], -1)  # values: [1, B, numel]
    return norms, [per_sample.piece([param], values, norms, add_rows)]


def _spread(work: list[tuple[int, Callable[[], Any]]], device: torch.device) -> list[Any]:
    """``[task() for _, task in work]``, in order; where :func:`_helpers_have_cores`, shared by :func:`_shares` (by
    each task's multiply-adds, its weight) between the step's own thread and helper threads (the groups are
    independent: their sums write other rows of the buffer, and the results come back in order)."""
    tasks = [task for _, task in work]
    if not _helpers_have_cores(device):
        return [task() for task in tasks]
    shares = _shares([weight for weight, _ in work], idle_cores() // torch.get_num_threads())
    pool = noise_pool(idle_cores())
    handed = [pool.submit(_in_ieee_float32, functools.partial(_each, [tasks[index] for index in share]))
              for share in shares]
    others = {index for share in shares for index in share}
    try:
        done = {index: task() for index, task in enumerate(tasks) if index not in others}
    finally:
        wait(handed)  # a failure on this thread is raised once the helpers are done (their exceptions are not lost)
    for share, future in zip(shares, handed):
        done.update(zip(share, future.result()))
    return [done[index] for index in range(len(work))]


def _shares(weights: list[int], helpers: int) -> list[list[int]]:
    """The tasks (indices) each of up to ``helpers`` helper threads takes: those of at least ``SPREAD_MIN_WORK``
    multiply-adds (their weights), largest first, each to the thread with the least work so far; the step's own
    thread keeps every smaller task (one costs more to hand over than to compute)."""
    loads = [sum(weight for weight in weights if weight < SPREAD_MIN_WORK)] + [0] * helpers
    shares: list[list[int]] = [[] for _ in loads]
    for index in sorted(range(len(weights)), key=lambda index: -weights[index]):
        if weights[index] < SPREAD_MIN_WORK:
            break
        least = loads.index(min(loads))
        shares[least].append(index)
        loads[least] += weights[index]
    return [sorted(share) for share in shares[1:] if share]


def _each(tasks: list[Callable[[], Any]]) -> list[Any]:
    return [task() for task in tasks]


def _in_ieee_float32(task: Callable[[], Any]) -> Any:
    """``task()`` on a helper thread, under the same numerics as the step's own thread."""
    with numerics.ieee_float32():
        return task()


def _joined(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """A layer's calls joined along the tokens."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)
