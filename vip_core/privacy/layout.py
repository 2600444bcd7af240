"""The per-sample layout: the loss with per-sample stand-ins for plain parameters, and the one-time check that the
model keeps its samples apart.

The rules take row i of every kept layer input and output gradient, and of every plain parameter's stand-in, to be
sample i's. :class:`LayoutCheck` verifies that once per model (:class:`~vip_core.privacy.engine.DPEngine`), on
its first microbatches of two or more samples, until every layer and plain parameter was reached: the gradients of
the first and the last sample's loss must be exactly zero in every other sample's rows of each layer's output and
each stand-in, and of the floating-point inputs (samples mixed before the first layer); and, on the first training
forward, that no parameter reaches the loss outside its layer's own forward (tied weights, a functional use).
:class:`WriteGuard` refuses, on every microbatch, a buffer or a parameter that the forwards or the backward changed. The
model and loss code are the user's and honest (``docs/privacy.md``, the trust model): the check finds mistakes and
unsupported layouts, it is not a defence against code that behaves differently once checked.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]
Inputs = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
_CAST_NODES = ("ToCopyBackward0",)


class UnsupportedLayerError(ValueError):
    """A trainable layer or parameter the engine cannot clip per sample; the message names it."""


def stand_ins(plain: list[tuple[str, nn.Parameter]], batch: int) -> dict[str, torch.Tensor]:
    """A ``[B, ...]`` stand-in per plain ``[1, ...]`` parameter: row i is sample i's copy."""
    return {name: p.detach().expand(batch, *p.shape[1:]).requires_grad_() for name, p in plain}


def per_sample_losses(model: nn.Module, loss_fn: LossFn, inputs: Inputs, swapped: dict[str, torch.Tensor],
                      batch: int) -> torch.Tensor:
    """``loss_fn(model, inputs)`` (``[B]``) with each plain parameter replaced by its stand-in (only the parameter's
    own entry: ``tie_weights=False``, since looking for other names of a tensor walks the whole model)."""
    if swapped:
        try:
            losses = functional_call(_LossCall(model, loss_fn), {f"model.{k}": v for k, v in swapped.items()},
                                     (inputs,), tie_weights=False)
        except RuntimeError as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UnsupportedLayerError(
                f"the model fails when its plain parameters ({', '.join(swapped)}) are given one copy per sample "
                f"([B, ...]): {reason}. A [1, ...] parameter must be broadcast against the batch dimension only"
            ) from error
    else:
        losses = loss_fn(model, inputs)
    if not isinstance(losses, torch.Tensor) or losses.shape != (batch,):
        shape = list(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(f"loss_fn must return one loss per sample, shape [{batch}], got {shape}")
    return losses


class _WrappedForward(functools.partial):
    """A forward swapped in by :func:`wrapped_forwards`."""


@contextlib.contextmanager
def wrapped_forwards(modules: Iterable[nn.Module], call: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Within the block, each module's ``forward`` is ``call(module, forward, *args, **kwargs)`` (``forward`` its
    own). Unlike a module hook, this keeps torch's fast call path, also sees a ``.forward(...)`` called directly, and
    sees the layer's own output, before any forward hook of the user's.

    Raises:
        RuntimeError: a module's forward is still wrapped (a Ctrl-C cut the undoing short, or engines were
            nested): its calls would be recorded twice, or by a block that has ended.
    """
    replaced: list[tuple[nn.Module, Any]] = []
    try:
        for module in modules:
            own = module.__dict__.get("forward")
            if isinstance(own, _WrappedForward):
                raise RuntimeError(f"a {type(module).__name__}'s forward is still wrapped by an earlier step (a Ctrl-C "
                                   "while it was being undone, or one engine inside another): start the process again")
            replaced.append((module, own))
            module.__dict__["forward"] = _WrappedForward(call, module, module.forward)
        yield
    finally:
        for module, own in replaced:
            if own is None:
                module.__dict__.pop("forward", None)  # an interrupt can fall between recording and swapping
            else:
                module.__dict__["forward"] = own


def output_edge(output: torch.Tensor) -> tuple[torch.Tensor, GradientEdge]:
    """The layer output to return and the autograd edge at which its gradient is asked for. A view (a Linear on
    [B, T, d] returns one of its [B·T, d] result) is asked for through its base, whose gradient has the same entries
    in the same order: an in-place operation on the view later would re-route the view's own node out of the graph,
    not the base's."""
    base = output._base
    if base is None:
        return output, get_gradient_edge(output)
    if output.is_contiguous() and base.is_contiguous() and base.numel() == output.numel() and (
            output.storage_offset() == base.storage_offset()):
        return output, get_gradient_edge(base)
    output = output.clone()
    return output, get_gradient_edge(output)


def edge_gradients(root: torch.Tensor, edges: list[GradientEdge], tensors: list[torch.Tensor], *,
                   retain_graph: bool = False,
                   arrived: Callable[[int, torch.Tensor | None], None] | None = None) -> tuple[list, list]:
    """The gradients of ``root`` at ``edges`` and at ``tensors`` (None where not reached). An edge's gradient is the
    one its node receives, after any tensor hook of the user's on the layer output, as the layer's weight gradient
    would be; ``arrived(index, grad)`` hears of each as the backward delivers it (an edge whose node the backward does
    not run, such as the first layer's, only at the end, from autograd's own answer)."""
    if not edges and not tensors:
        return [], []
    received: dict[int, torch.Tensor | None] = {}

    def heard(index: int, output_nr: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        received[index] = grads[output_nr]
        if arrived is not None:
            arrived(index, grads[output_nr])

    handles = [edge.node.register_prehook(functools.partial(heard, index, edge.output_nr))
               for index, edge in enumerate(edges)]
    try:
        grads = torch.autograd.grad(root, [*edges, *tensors], retain_graph=retain_graph, allow_unused=True)
    finally:
        for handle in handles:  # the graph must not hold the listener (nor, through it, the caller)
            handle.remove()
    return [received.get(index, grad) for index, grad in enumerate(grads[:len(edges)])], list(grads[len(edges):])


class _LossCall(nn.Module):
    """``loss_fn(model, inputs)`` as a module, so ``functional_call`` can swap in the stand-ins."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: Inputs) -> torch.Tensor:
        return self.loss_fn(self.model, inputs)


class LayoutCheck:
    """What is left to check of one model: the layers and plain parameters not reached yet, the inputs, and the
    first training microbatch's parameter uses and buffers."""

    def __init__(self, layers: list[tuple[str, nn.Module]], plain: list[tuple[str, nn.Parameter]]) -> None:
        self.layers = layers
        self.plain = plain
        self.unreached = {name for name, _ in layers} | {name for name, _ in plain}
        self.inputs_checked = False
        self.input_tries = 0
        self.uses_checked = False

    @property
    def done(self) -> bool:
        """Whether every layer, plain parameter and the inputs were checked."""
        return not self.unreached and self.inputs_checked

    def check(self, model: nn.Module, loss_fn: LossFn, inputs: Inputs, batch: int) -> None:
        """Checks the layout on this microbatch while anything is left (a microbatch of one sample proves nothing)."""
        if batch < 2 or self.done:
            return
        with torch.autograd.set_detect_anomaly(False):  # it would raise on the NaN entries passed over
            reached = self._check_layers(model, loss_fn, inputs, batch)
            if reached is None:
                return
            self.unreached -= reached
            if not self.inputs_checked:
                self.inputs_checked = self._check_inputs(model, loss_fn, inputs, batch)
                self.input_tries += 1
                if not self.inputs_checked and self.input_tries >= _INPUT_TRIES:
                    logger.warning("the per-sample layout check left this model's inputs unchecked: on %d microbatches "
                                   "the first or the last sample's loss was not finite, or reached its own inputs only "
                                   "where the gradient is 0 (floor, round, a ReLU or clamp on its flat part) or not "
                                   "at all (docs/privacy.md, rule 5)", self.input_tries)
                    self.inputs_checked = True

    def check_uses(self, losses: torch.Tensor, uses: dict[nn.Parameter, tuple[str, Any]],
                   layers_of_nodes: Callable[[], dict[Any, nn.Module]]) -> None:
        """On the first training forward: refuses a parameter used outside its layer (``uses``: each parameter's name
        and its layer module, or None for a plain parameter; ``layers_of_nodes``: each kept call's output node, with
        its layer)."""
        if not self.uses_checked and losses.requires_grad:
            _check_parameter_uses(losses, uses, layers_of_nodes())
        self.uses_checked = True

    def _check_layers(self, model: nn.Module, loss_fn: LossFn, inputs: Inputs, batch: int) -> set[str] | None:
        """The names reached by both checked samples' losses, or None when the microbatch proves nothing (a loss
        not finite, a NaN in another sample's rows)."""
        swapped = stand_ins(self.plain, batch)
        names = {module: name for name, module in self.layers}
        outputs: list[tuple[str, torch.Size, GradientEdge]] = []

        def keep(module: nn.Module, forward: Callable, *args: Any, **kwargs: Any) -> Any:
            output = forward(*args, **kwargs)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output, edge = output_edge(output)
                outputs.append((names[module], output.shape, edge))
            return output

        with wrapped_forwards(names, keep):
            losses = per_sample_losses(model, loss_fn, inputs, swapped, batch)
        watched = [(name, tensor.shape) for name, tensor in swapped.items()] + [(n, s) for n, s, _ in outputs]
        reached = Counter()
        for sample in _checked_samples(batch):
            if not _proves_something(losses[sample]):
                return None
            at_edges, at_stand_ins = edge_gradients(losses[sample], [edge for _, _, edge in outputs],
                                                    list(swapped.values()), retain_graph=True)
            for (name, shape), grad in zip(watched, at_stand_ins + at_edges):
                if grad is None:
                    continue
                grad = grad.reshape(shape)  # a view's gradient comes as its base's
                others = _other_rows(grad, sample)
                if bool(others.isnan().any()):
                    return None
                if bool((others != 0).any()):
                    raise UnsupportedLayerError(_mixing_message(name, swapped, sample))
                if bool((grad[sample] != 0).any()):  # a branch dropped for this sample shows nothing
                    reached[name] += 1
        return {name for name, count in reached.items() if count == len(_checked_samples(batch))}

    def _check_inputs(self, model: nn.Module, loss_fn: LossFn, inputs: Inputs, batch: int) -> bool:
        """Refuses a model or loss in which the first or the last sample's loss depends on another sample's rows of
        an input (``x - x.mean(0)`` before the first layer), in a forward of its own: a floating-point or complex
        input is watched as it is, an integer one (uint8 pixels, indices into a data set) where the model first turns
        it into floating point (:class:`_WatchConversions`). NaN entries (0 · log 0) are passed over; a model that
        cannot run on inputs requiring grad (``.numpy()``) is not checked here, and a warning says so. False when the
        microbatch proves nothing (a loss not finite, or a checked sample whose loss does not reach its own rows).

        The check runs at three points (:data:`_POINTS`), since crafted data can sit where a dependence is flat (the
        NaN of sqrt at a batch std of 0 on identical images, a clamp saturated by black-and-white images): the data's
        own, a nearby one and one spread over [0, 1] and the data's range. Only the data's own point must prove
        something; the others warn when the model raises or is not finite there."""
        return all([self._check_inputs_at(model, loss_fn, inputs, batch, point) for point in _POINTS])

    def _check_inputs_at(self, model: nn.Module, loss_fn: LossFn, inputs: Inputs, batch: int,
                         point: str) -> bool:
        """One input check at ``point`` (:data:`_POINTS`): the data's own, a nearby generic one (each watched entry
        moved by a small deterministic offset, towards the inside of the data's range), or a spread one."""
        try:
            return self._check_inputs_at_point(model, loss_fn, inputs, batch, point)
        except UnsupportedLayerError:
            raise
        except Exception as error:  # the model's own checks (a distribution's support, an assert) at a new point
            if point == "data":
                raise
            _warn_unchecked_at(point, f"its forward or loss_fn raised {type(error).__name__} there")
            return True

    def _check_inputs_at_point(self, model: nn.Module, loss_fn: LossFn, inputs: Inputs, batch: int,
                               point: str) -> bool:
        jitter = point != "data"
        watched_inputs, leaves = _watched_inputs(inputs, point)
        conversions = _WatchConversions(inputs, batch, point)
        per_sample = []
        try:
            with conversions:
                losses = per_sample_losses(model, loss_fn, watched_inputs, stand_ins(self.plain, batch), batch)
            leaves = leaves + conversions.leaves
            if conversions.unwatched and not jitter:
                logger.warning("the per-sample layout check could not watch the integer inputs %s: the model never "
                               "made them floating point with the batch on dim 0 inside torch (e.g. it indexed a data "
                               "set with Python integers, or mixed them with other rows before), so samples mixed "
                               "after them cannot be seen (docs/privacy.md, rule 5)", ", ".join(conversions.unwatched))
            if not leaves:
                return True
            for sample in _checked_samples(batch):
                if not _proves_something(losses[sample]):
                    if jitter:
                        _warn_unchecked_at(point, "the loss is not finite there")
                        return True
                    return False
                per_sample.append((sample, torch.autograd.grad(
                    losses[sample], [leaf for _, leaf in leaves], retain_graph=True, allow_unused=True)))
        except (RuntimeError, NotImplementedError, UnsupportedLayerError) as error:
            logger.warning("the per-sample layout check left this model's inputs unchecked: its forward or loss_fn "
                           "raised %s on inputs that require grad, so samples mixed before the first layer cannot be "
                           "seen (docs/privacy.md, rule 5)", type(error).__name__)
            return True
        _refuse_mixed_rows(per_sample, leaves)
        # a checked sample whose loss reaches an input but not its own rows of it (an unlabelled sample under
        # ignore_index, an image all padding under a masked loss) proves nothing about the others' rows
        return jitter or all(all(grad is None or _has_signal(grad[sample]) for grad in grads)
                             for sample, grads in per_sample)


def _warn_unchecked_at(point: str, reason: str) -> None:
    logger.warning("the per-sample layout check left this model's inputs unchecked at a %s point: %s "
                   "(docs/privacy.md, rule 5)", point, reason)


def _has_signal(grad: torch.Tensor) -> bool:
    """Whether ``grad`` holds a finite non-zero entry (NaN entries, as 0 · log 0, are passed over)."""
    return bool(((grad != 0) & ~grad.isnan()).any())


def _refuse_mixed_rows(per_sample: list[tuple[int, tuple]], leaves: list[tuple[str, torch.Tensor]]) -> None:
    """Refuses a checked sample whose loss has a finite non-zero gradient in another sample's rows of an input."""
    for sample, grads in per_sample:
        for (name, _), grad in zip(leaves, grads):
            if grad is not None and _has_signal(_other_rows(grad, sample)):
                raise UnsupportedLayerError(
                    f"sample {sample}'s loss depends on other samples' rows of {name}: the model or loss_fn mixes "
                    "samples (batch statistics such as x - x.mean(0), or a loss normalised over the batch), and "
                    "per-sample clipping needs each sample's loss to depend on its own inputs only")


class WriteGuard:
    """What a microbatch on private data (its forwards and backward) must not change: every module's buffers (which
    names, which tensors, their versions; running statistics computed from the batch would be published without
    noise), every parameter's version, trainable or frozen (private data written into a weight, by an Embedding's
    ``max_norm``, a data-dependent initialisation or a unit recycled from an input, escapes clipping and noise), and
    the model's modules and parameters (one created or replaced in a forward would hold what it was made from).
    Writes that bypass autograd's version counter (through ``.data``) are not seen: ``docs/privacy.md``, rule 5."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules = list(model.named_modules())
        self.params = list(model.named_parameters())
        self.tree = [module for _, module in self.modules]
        self.structure = tree_state(self.tree)

    def snapshot(self) -> tuple[dict[int, tuple], list[int]]:
        """Each module's buffers (by the module's index; modules without any left out) with their versions, and every
        parameter's version."""
        buffers = {index: tuple((key, tensor, _version(tensor)) for key, tensor in table.items())
                   for index, table in _buffer_tables(self.tree)}
        return buffers, [param._version for _, param in self.params]

    def moved(self) -> bool:
        """Whether a module or parameter was added to, replaced in, frozen, unfrozen or moved in the model since the
        guard was made (with the engine's plan)."""
        return tree_state(self.tree) != self.structure

    def check_structure(self) -> None:
        """Refuses such a change made by the forwards or backward, or between the microbatches of one sum."""
        if self.moved():
            raise UnsupportedLayerError(
                "a module or parameter was added to, replaced in, frozen, unfrozen or moved in the model while "
                "training on private data (a lazily created layer, a weight re-made from an input): it could hold "
                "what it was made from, and the plan no longer matches the model; make such changes before training "
                "or between steps")

    def check(self, before: tuple[dict[int, tuple], list[int]]) -> None:
        """Refuses, by name, a buffer or a parameter that changed since ``before`` (a :meth:`snapshot`)."""
        buffers, versions = before
        now = dict(_buffer_tables(self.tree))
        for index in buffers.keys() | now.keys():
            entries, table = buffers.get(index, ()), now.get(index, {})
            if len(table) != len(entries) or any(key != old_key or tensor is not old or _version(tensor) != version
                                                 for (key, tensor), (old_key, old, version)
                                                 in zip(table.items(), entries)):
                prefix = self.modules[index][0]
                names = ", ".join(f"'{prefix}.{key}'" if prefix else f"'{key}'" for key in table) or "(removed)"
                raise UnsupportedLayerError(
                    f"buffer {names} changed while training on private data (e.g. running statistics): it would be "
                    "computed from private data without noise and published with the weights; set its module to "
                    "eval mode or stop it tracking statistics")
        if [param._version for _, param in self.params] == versions:
            return
        for (name, param), version in zip(self.params, versions):
            if param._version != version:
                raise UnsupportedLayerError(
                    f"parameter '{name}' was written to while training on private data (e.g. an Embedding's max_norm "
                    "renormalising the rows it looked up, a data-dependent initialisation): private data would reach "
                    "the weights without clipping or noise")


def _buffer_tables(modules: list[nn.Module]) -> list[tuple[int, dict[str, torch.Tensor | None]]]:
    """Each module that has buffers, by its index in ``modules``, with its own table of them (most modules have
    none: skipping them keeps the per-microbatch snapshot cheap)."""
    return [(index, module._buffers) for index, module in enumerate(modules) if module._buffers]


def tree_state(modules: list[nn.Module]) -> tuple:
    """Each module's children (by identity), how many parameters each module holds, and every parameter's identity,
    requires_grad, dtype and device, read from the modules' own tables (the flat identities with the counts give each
    module's own). ``modules`` is the whole tree as it was, held by the caller (so no id is reused): a module or
    parameter added, replaced, frozen, unfrozen or moved anywhere changes the table of one of them. Empty tables (most
    modules have no children or no parameters) are not walked."""
    children = [tuple(map(id, module._modules.values())) if module._modules else () for module in modules]
    tables = [module._parameters for module in modules]
    values = [value for table in tables if table for value in table.values()]
    params = [param for param in values if param is not None]
    return (children, [len(table) for table in tables], list(map(id, values)), [p.requires_grad for p in params],
            [p.dtype for p in params], [p.device for p in params])


def _version(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor._version


class _WatchConversions(TorchFunctionMode):
    """Watches where the model turns an integer input (or an integer tensor computed from one) into floating point
    with the batch on dim 0 (``pixels.float() / 255``, ``images[indices]``): a zero leaf that requires grad, named
    after the input, is added to that result (the graph through it kept), so the input check can see the samples'
    rows mixed after it."""

    def __init__(self, inputs: Inputs, batch: int, point: str = "data") -> None:
        super().__init__()
        self.batch = batch
        self.point = point
        # the inputs a mixed result reached a floating-point tensor from (p.float() / p.amax(): the batch maximum
        # of the pixels, beside a clean conversion of them)
        self.mixed_into: set[str] = set()
        # id -> tensor: results computed from a followed tensor whose rows are not (or not known to be) the samples
        # (p.flip(0), p.min(0), p[i], a list of per-image copies): what they flow into is not followed either
        self.mixed: dict[int, tuple[str, torch.Tensor]] = {}
        # id -> (name, tensor): the tensor is held, so that its id cannot be reused by another
        self.sources = {id(t): (name, t) for name, t in _named_tensors(inputs)
                        if not (t.is_floating_point() or t.is_complex())}
        self.leaves: list[tuple[str, torch.Tensor]] = []
        self.watched: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        operands = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        sources = [self.sources[id(a)][0] for a in operands if id(a) in self.sources and self.sources[id(a)][1] is a]
        mixed = [self.mixed[id(a)][0] for a in operands if self.mixed.get(id(a), (None, None))[1] is a]
        name = _function_name(func)
        written = args[0] if name == "__setitem__" else out  # ``buf[:] = pixels`` fills ``buf``, returns None
        if not sources and not mixed:
            return out
        if not mixed and isinstance(out, (tuple, list)) and name != "__setitem__" and out and all(
                isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == self.batch
                and not (t.is_floating_point() or t.is_complex()) for t in out) and _off_batch(name, args, kwargs or {}):
            for tensor in out:  # p.aminmax(dim=1), p.flatten(1).max(1), p.unbind(1): one sample per row
                self.sources[id(tensor)] = (sources[0], tensor)
            return out
        if (mixed or not isinstance(written, torch.Tensor) or written.dim() == 0 or written.shape[0] != self.batch
                or (name in _REARRANGES and not self._keeps_rows(func, name, args, kwargs or {}, written))):
            source = (sources or mixed)[0]
            for tensor in tree_leaves(written if isinstance(written, torch.Tensor) else out):
                if isinstance(tensor, torch.Tensor):
                    self.mixed[id(tensor)] = (source, tensor)
                    self.sources.pop(id(tensor), None)
                    if mixed and (tensor.is_floating_point() or tensor.is_complex()):
                        self.mixed_into.add(source)
            return out
        out = written
        if not (out.is_floating_point() or out.is_complex()):
            self.sources[id(out)] = (sources[0], out)  # still integer: follow it
            return out
        plain = name in _CONVERSIONS and any(self._follows(a) and a.dtype == torch.uint8 for a in operands)
        leaf = _offset(out, self.point, whole=torch.uint8 if plain else None).requires_grad_()
        self.leaves.append((f"{sources[0]} (made floating point by {name})", leaf))
        self.watched.add(sources[0])
        if any(out is a for a in operands):  # in place or out=: the model goes on with that very tensor
            with torch.enable_grad():
                return out.add_(leaf)
        return out + leaf

    def _follows(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor) and self.sources.get(id(tensor), (None, None))[1] is tensor

    def _keeps_rows(self, func: Any, name: str, args: tuple, kwargs: dict, written: torch.Tensor) -> bool:
        """Whether each element of ``func``'s row j comes from row j of the inputs it rearranges, or from none of them
        (a constant such as coordinate channels): the same call with each followed operand replaced by its row ids
        (row i holds i), then by its row ids plus B, must move an element by B exactly where it holds j, and leave
        it alone elsewhere. Where a followed tensor is not the operand (``table[indices]``), the rows are the index's."""
        if name in ("view", "view_as") and written.dim() >= 2 and (
                (len(args) == 2 and isinstance(args[1], torch.dtype)) or isinstance(kwargs.get("dtype"), torch.dtype)):
            return True  # a dtype view regroups the last dim only (the id probe's int32 would overflow an int8)
        if name == "einsum":  # the equation first, then the operands (or a list of them)
            equation, rest = args[0], args[1:]
            operand = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else list(rest)
            func, args = (lambda ops, *_, **kw: torch.einsum(equation, *ops)), (operand,)
        operand = _operand(args, kwargs)
        operands = operand if isinstance(operand, (list, tuple)) else (operand,)
        if not any(self._follows(t) for t in operands):
            return True
        kwargs = {key: value for key, value in kwargs.items() if key != "out"}  # never write into the model's tensor
        key = "tensors" if "tensors" in kwargs else "input"
        results = []
        for shift in (0, self.batch):
            probe = [_row_ids(t) + shift if self._follows(t) else t for t in operands]
            probe = probe if isinstance(operand, (list, tuple)) else probe[0]
            try:
                result = func(probe, *args[1:], **kwargs) if args else func(**{**kwargs, key: probe})
            except (IndexError, RuntimeError, TypeError, ValueError):
                return False
            if not isinstance(result, torch.Tensor) or result.dim() == 0 or result.shape[0] != self.batch:
                return False
            results.append(result)
        rows = torch.arange(self.batch, device=results[0].device).view(-1, *[1] * (results[0].dim() - 1))
        own = (results[0] == rows) & (results[1] == rows + self.batch)
        return bool((own | (results[0] == results[1])).all())

    @property
    def unwatched(self) -> list[str]:
        """The integer inputs no floating-point result was watched for, or whose rows mixed reached one."""
        return sorted(({name for name, _ in self.sources.values()} - self.watched) | self.mixed_into)


# Operations that rearrange their operands' elements: their result holds the samples on dim 0 only where each row
# is one sample's (``pixels.permute(0, 3, 1, 2)`` or a per-sample crop is; ``pixels.T`` of a square batch, or
# ``pixels[i]`` or ``torch.stack([pixels[:, 2], pixels[:, 1], pixels[:, 0]])`` of a batch as long as its channels,
# is not, whatever its shape says).
_REARRANGES = frozenset({"T", "mT", "H", "mH", "t", "transpose", "permute", "movedim", "moveaxis", "swapaxes",
                         "swapdims", "__getitem__", "select", "narrow", "index_select", "gather", "stack", "cat",
                         "concat", "concatenate", "reshape", "view", "flatten", "unflatten", "expand", "repeat",
                         "einsum", "flip", "flipud", "fliplr", "roll", "rot90", "tile", "take_along_dim"})


_POINTS = ("data", "near", "spread")
_INPUT_TRIES = 8
_CONVERSIONS = frozenset({"float", "double", "half", "bfloat16", "to", "type", "type_as"})
# tuple-returning operations along one dim: where that dim is given (position of ``dim`` after the tensor, default)
_ALONG_DIM = {"max": (1, None), "min": (1, None), "median": (1, None), "nanmedian": (1, None), "mode": (1, -1),
              "cummax": (1, None), "cummin": (1, None), "kthvalue": (2, -1), "topk": (2, -1), "sort": (1, -1),
              "aminmax": (None, None), "unbind": (1, 0), "split": (2, 0), "chunk": (2, 0), "tensor_split": (2, 0)}


def _off_batch(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a tuple-returning ``name`` acts along a given dim other than the batch's (dim 0)."""
    if name not in _ALONG_DIM or not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
        return False
    position, default = _ALONG_DIM[name]
    dim = kwargs.get("dim", args[position] if position is not None and len(args) > position else default)
    return isinstance(dim, int) and not isinstance(dim, bool) and dim % args[0].dim() != 0


def _offset(tensor: torch.Tensor, point: str, whole: torch.dtype | None = None) -> torch.Tensor:
    """What moves ``tensor`` (floating point) to ``point``, the same on every call (a generator of its own: the user's
    stream is left alone): nothing at the data's point; near it, a small offset per entry relative to the entry's
    size, upwards unless that leaves the data's range and downwards does not; spread, to a value drawn uniformly
    over the data's range (0..255 where ``whole`` is uint8 and the data lies within it; widened where the range is
    one value), whatever the data."""
    if point == "data":
        return torch.zeros_like(tensor)
    generator = torch.Generator().manual_seed(0)
    u = torch.rand(tensor.shape, generator=generator, dtype=torch.float64)
    x = tensor.detach().double().cpu()
    if tensor.is_complex():
        x = x.real
    lo, hi = (float(x.min()), float(x.max())) if x.numel() else (0.0, 1.0)
    if point == "near":
        offset = 1e-2 * u * (1 + x.abs())
        offset = torch.where((x + offset > hi) & (x - offset >= lo), -offset, offset)
    else:
        if whole == torch.uint8 and lo >= 0 and hi <= 255:
            lo, hi = 0.0, 255.0
        # never narrower than [0, 1] (where images and their conversions live): crafted data cannot choose a range
        # of its own, bright images in [0.8, 1], where a brightness clamp is flat
        lo, hi = min(lo, 0.0), max(hi, 1.0)
        if hi - lo <= 1e-6 * (1 + abs(hi)):
            lo, hi = lo - 0.5 * (1 + abs(lo)), hi + 0.5 * (1 + abs(hi))
        offset = lo + (hi - lo) * u - x
    return offset.to(dtype=tensor.dtype, device=tensor.device)


def _row_ids(tensor: torch.Tensor) -> torch.Tensor:
    """An int32 tensor of ``tensor``'s shape and device whose row i holds i."""
    rows = torch.arange(tensor.shape[0], dtype=torch.int32, device=tensor.device)
    return rows.view(-1, *[1] * (tensor.dim() - 1)).expand(tensor.shape).contiguous()


def _operand(args: tuple, kwargs: dict) -> Any:
    """The tensor (or tensors) a method or torch function acts on: its first argument, ``input=`` or ``tensors=``."""
    return args[0] if args else kwargs.get("input", kwargs.get("tensors"))


def _function_name(func: Any) -> str:
    """A torch function's name; a property's (``Tensor.T``) where the function is its getter."""
    name = getattr(func, "__name__", str(func))
    return getattr(getattr(func, "__self__", None), "__name__", name) if name == "__get__" else name


def _named_tensors(inputs: Inputs) -> list[tuple[str, torch.Tensor]]:
    if isinstance(inputs, torch.Tensor):
        return [("input", inputs)]
    if isinstance(inputs, Mapping):
        return [(f"input[{key!r}]", value) for key, value in inputs.items()]
    return [(f"input[{index}]", value) for index, value in enumerate(inputs)]


def _checked_samples(batch: int) -> list[int]:
    """The samples whose losses the layout check differentiates: the first and the last."""
    return sorted({0, batch - 1})


def _proves_something(loss: torch.Tensor) -> bool:
    return loss.requires_grad and bool(torch.isfinite(loss))


def _other_rows(grad: torch.Tensor, sample: int) -> torch.Tensor:
    return torch.cat([grad[:sample], grad[sample + 1:]])


def _watched_inputs(inputs: Inputs, point: str = "data") -> tuple[Inputs, list[tuple[str, torch.Tensor]]]:
    """``inputs`` with each floating-point or complex tensor replaced by a copy of a new leaf that requires grad (a
    copy, so that the model may still write into it in place), and those leaves by name (``input``, ``input[k]``)."""
    leaves: list[tuple[str, torch.Tensor]] = []

    def watched(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            return tensor
        leaf = (tensor.detach() + _offset(tensor, point)).requires_grad_()
        leaves.append((name, leaf))
        return leaf.clone()

    if isinstance(inputs, torch.Tensor):
        return watched("input", inputs), leaves
    if isinstance(inputs, Mapping):
        return {key: watched(f"input[{key!r}]", value) for key, value in inputs.items()}, leaves
    return type(inputs)(watched(f"input[{index}]", value) for index, value in enumerate(inputs)), leaves


def _mixing_message(name: str, swapped: dict[str, torch.Tensor], sample: int) -> str:
    if name in swapped:
        shape = [1, *swapped[name].shape[1:]]
        return (f"plain parameter '{name}' {shape} is not broadcast against the batch alone: sample {sample}'s loss "
                "reaches other samples' copies of it, so its per-sample gradient would mix samples (e.g. a [1, D] "
                "parameter added to [B, T, D]); give it shape [1, 1, D]")
    return (f"layer '{name}': sample {sample}'s loss reaches other rows of the layer's output, so dim 0 is not the "
            "sample (a sequence-first or flattened layout); per-sample clipping needs the batch on dim 0")


def _check_parameter_uses(losses: torch.Tensor, uses: dict[nn.Parameter, tuple[str, Any]],
                          layers_of_nodes: dict[Any, nn.Module]) -> None:
    """Each layer parameter must reach the loss once per call of its layer that reaches the loss, and nowhere else;
    a plain parameter only through its stand-in. Otherwise a gradient would escape clipping."""
    edges, calls = _graph_uses(losses.grad_fn, set(uses), layers_of_nodes)
    for param, (name, layer) in uses.items():
        expected = 0 if layer is None else calls[layer]
        if edges[param] != expected:
            raise UnsupportedLayerError(
                f"a parameter of '{name}' reaches the loss {edges[param]} time(s) but its layer ran {expected} "
                "time(s): it is used outside the layer's own forward (tied or functional use, or held as a buffer), "
                "which cannot be clipped per sample")


def _graph_uses(root: Any, params: set[nn.Parameter],
                layers_of_nodes: dict[Any, nn.Module]) -> tuple[Counter, Counter]:
    """From ``root``: how many autograd edges lead into each of ``params`` (through autocast casts), and how many
    kept calls of each layer (their output nodes, ``layers_of_nodes``) are reached."""
    edges: Counter[nn.Parameter] = Counter()
    calls: Counter[Any] = Counter()
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        layer = layers_of_nodes.get(node)
        if layer is not None:
            calls[layer] += 1
        for child, _ in node.next_functions:
            if child is None:
                continue
            param = _leaf_param(child)
            if param is not None:
                if param in params:
                    edges[param] += 1
            elif child not in seen:
                seen.add(child)
                stack.append(child)
    return edges, calls


def _leaf_param(node: Any) -> torch.Tensor | None:
    """The parameter behind an AccumulateGrad node, or behind an autocast cast of one; else None."""
    variable = getattr(node, "variable", None)
    if variable is not None:
        return variable
    if node.name() in _CAST_NODES and len(node.next_functions) == 1:
        (inner, _), = node.next_functions
        return getattr(inner, "variable", None) if inner is not None else None
    return None
