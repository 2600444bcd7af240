"""One logical training step on a Poisson sample: private (vip's one private step) or plain (DP off).

:class:`PrivateStep` is the only code in vip that adds noise or advances a privacy ledger (a test checks
the import graph). It is composed once, from one :class:`~vip_core.privacy.plan.PrivacyPlan`, of:

* the Poisson sampler of this rank's block of the data at the plan's q (the q the ledger accounts);
* random streams keyed with 128 bits of fresh OS entropy (:mod:`vip_core.privacy.randomness`), never a
  config seed: sampling, noise, and per-sample randomness (MAE masks, augmentation) handed to the batch;
* the engine: per-sample clipping over every trainable parameter, the sum divided by the plan's expected
  batch size B, Gaussian noise N(0, σ²C²) added once per step (on rank 0 only; the SUM all-reduce then
  gives total std σC whatever the number of workers);
* DP-AdamW over every trainable parameter and its learning-rate schedule;
* the ledger: ε of the data set (this run composed with the set's other runs) after every step, and
  :meth:`PrivateStep.can_step` before it.

Pre-training (the Ray worker), DP fine-tuning and the audit all call it. :class:`PlainStep` is the DP-off
variant of the same step (the synthetic stage): the mean loss's gradient over the realised batch of every
rank, streams keyed by the public config seed, so a public run is deterministic for its config.

A step asks two functions of its caller: ``batch(local_indices, sample_stream) -> inputs`` (the sample's
data, e.g. the uint8 images an :class:`~vip_core.train.pipeline.InputPipeline` decoded ahead (see
:meth:`TrainingStep.prefetch`), or just the indices, and its per-sample randomness) and
``loss_fn(model, inputs) -> [b]`` per-sample losses, called one microbatch at a time.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.profiler import record_function

from vip_core.privacy.engine import DPEngine, Inputs, split_batch
from vip_core.privacy.ledger import PrivacyLedger
from vip_core.privacy.optimizer import dp_adamw, set_learning_rate
from vip_core.privacy.plan import PrivacyPlan
from vip_core.privacy.randomness import Mode, RandomStream, private_entropy
from vip_core.privacy.sampling import PoissonSampler
from vip_core.train.distributed import (
    all_reduce_gradients, all_reduce_in_place, all_reduce_sum, rank_and_world, rank_noise_multiplier,
    trainable_parameters,
)
from vip_core.train.pipeline import DECODE_MODE, InputPipeline, Load
from vip_core.train.schedule import Schedule

Batch = Callable[[torch.Tensor, RandomStream], Inputs]
LossFn = Callable[[nn.Module, Inputs], torch.Tensor]
Observer = Callable[[nn.Module], None]


def _no_epsilon() -> None:
    """ε where there is none: a step without privacy, or a rank other than 0."""
    return None


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One step's metrics. ``loss`` and ``examples`` are computed from the (private) data and are not
    privatized: monitoring only (docs/privacy.md lists where they go). ``epsilon_of`` computes :attr:`epsilon`
    when asked, on any thread: a PLD accountant takes up to seconds a call, which the step does not wait for."""

    step: int
    lr: float
    loss: float
    examples: int
    seconds: float
    epsilon_of: Callable[[], float | None] = dataclasses.field(default=_no_epsilon, repr=False, compare=False)

    @property
    def epsilon(self) -> float | None:
        """ε after this step (rank 0 of a private step; None elsewhere)."""
        return self.epsilon_of()


class Streams:
    """The random streams of one rank: Poisson sampling, noise, per-sample randomness."""

    def __init__(self, entropy: int, rank: int, mode: Mode = "default") -> None:
        self.sampling = RandomStream(entropy, rank, "sampling", mode)
        self.noise = RandomStream(entropy, rank, "noise", mode)
        self.sample = RandomStream(entropy, rank, "sample", mode)

    def state_dict(self) -> dict[str, Any]:
        return {"noise": self.noise.state_dict(), "sample": self.sample.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.noise.load_state_dict(state["noise"])
        self.sample.load_state_dict(state["sample"])


class TrainingStep(abc.ABC):
    """What the private and the plain step share: sampler, streams, AdamW, schedule, step count.

    Args:
        model: the model; every trainable parameter is trained.
        schedule: the learning-rate schedule.
        streams: this rank's random streams.
        local_size: examples in this rank's block of the data.
        sample_rate: q.
        physical_batch_size: microbatch bound (memory only).
        betas: AdamW's moment decays.
        weight_decay: AdamW's decoupled weight decay.
        param_groups: optimiser groups of one's own (each may carry an ``lr_scale``); decay/no-decay when None.
    """

    def __init__(self, model: nn.Module, *, schedule: Schedule, streams: Streams, local_size: int,
                 sample_rate: float, physical_batch_size: int | None, betas: tuple[float, float],
                 weight_decay: float, param_groups: list[dict] | None = None) -> None:
        self.model = model
        self.rank, self.world = rank_and_world()
        self.schedule = schedule
        self.streams = streams
        self.sampler: PoissonSampler | InputPipeline = PoissonSampler(local_size, sample_rate, streams.sampling)
        self.physical_batch_size = physical_batch_size
        self.optimizer = dp_adamw(model, lr=schedule.peak_lr, betas=betas, weight_decay=weight_decay,
                                  param_groups=param_groups)
        self.taken = 0

    def prefetch(self, load: Load, *, ahead: int = 2, workers: int = 2, mode: str = DECODE_MODE,
                 pin_memory: bool = False) -> InputPipeline:
        """Draws this step's Poisson samples ``ahead`` steps in advance from the same sampler and decodes them
        with ``load`` in ``workers`` decoding processes or threads (``mode``:
        :class:`~vip_core.train.pipeline.InputPipeline`); the sampler state in :meth:`stream_state` stays that
        of the last step taken."""
        self.sampler = InputPipeline(self.sampler, load, ahead=ahead, workers=workers, mode=mode,
                                     pin_memory=pin_memory)
        return self.sampler

    @property
    def epsilon(self) -> float | None:
        """ε of the data set so far; None for a plain step."""
        return None

    def can_step(self) -> bool:
        """Whether one more step keeps within the budget (always, without privacy)."""
        return True

    def __call__(self, batch: Batch, loss_fn: LossFn, observe: Observer | None = None) -> StepReport:
        """Takes one logical step.

        Args:
            batch: ``batch(local_indices [k], sample_stream) -> inputs`` for the Poisson sample.
            loss_fn: ``loss_fn(model, inputs) -> [b]`` per-sample losses.
            observe: called with the model once the gradients are set, before the optimiser step; it may read them
                only.
        """
        started = time.perf_counter()
        lr = self.schedule.lr(self.taken)
        set_learning_rate(self.optimizer, lr)
        local = self.sampler.sample()  # local: [k], k ~ Binomial(local_size, q)
        loss_sum, examples = self._gradients(batch(local, self.streams.sample), loss_fn)
        if observe is not None:
            observe(self.model)
        with record_function("vip.optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        epsilon_of = self._epsilon_of()
        return StepReport(step=self.taken, lr=lr, loss=loss_sum / max(examples, 1.0), examples=int(examples),
                          seconds=time.perf_counter() - started, epsilon_of=epsilon_of)

    @abc.abstractmethod
    def _gradients(self, inputs: Inputs, loss_fn: LossFn) -> tuple[float, float]:
        """Sets ``.grad`` of every trainable parameter, counting the step (:meth:`_count`) before; returns the
        (all-reduced) loss sum and example count."""

    def _count(self) -> None:
        """Counts the step, before its gradients are set: a step that fails after this is counted."""
        self.taken += 1

    def _epsilon_of(self) -> Callable[[], float | None]:
        """What computes ε after the step."""
        return _no_epsilon

    def state_dict(self) -> dict[str, Any]:
        """What every rank shares: the step count and the optimiser state."""
        return {"step": self.taken, "optimizer": self.optimizer.state_dict()}

    def stream_state(self) -> dict[str, Any]:
        """This rank's own state: the sampler's and the streams'."""
        return {"sampler": self.sampler.state_dict(), "streams": self.streams.state_dict()}

    def load_state_dict(self, state: dict[str, Any], stream_state: dict[str, Any] | None = None) -> None:
        """Continues from :meth:`state_dict` (and this rank's :meth:`stream_state`, when it has one)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.taken = int(state["step"])
        if stream_state is not None:
            self.sampler.load_state_dict(stream_state["sampler"])
            self.streams.load_state_dict(stream_state["streams"])


class PrivateStep(TrainingStep):
    """The one private step: Poisson sample, clipped per-sample gradients, noise once, DP-AdamW, ledger.

    Args:
        model: the model; every trainable parameter must be one the engine can clip per sample.
        plan: the privacy plan (q, σ, C, B, δ, accountant, the set's other runs, secure mode).
        schedule: the learning-rate schedule.
        local_size: examples in this rank's block; the whole data set (the plan's N) when None.
        physical_batch_size: microbatch bound (memory only).
        betas: AdamW's moment decays.
        weight_decay: AdamW's decoupled weight decay.
        param_groups: optimiser groups of one's own; decay/no-decay when None.
        earlier_runs: how many runs of the same plan came before this one (their steps count in ε).
    """

    def __init__(self, model: nn.Module, plan: PrivacyPlan, schedule: Schedule, *, local_size: int | None = None,
                 physical_batch_size: int | None, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.05, param_groups: list[dict] | None = None, earlier_runs: int = 0) -> None:
        rank, _ = rank_and_world()
        streams = Streams(private_entropy(), rank, "secure" if plan.secure_mode else "default")
        super().__init__(model, schedule=schedule, streams=streams,
                         local_size=plan.dataset_size if local_size is None else local_size,
                         sample_rate=plan.sample_rate, physical_batch_size=physical_batch_size, betas=betas,
                         weight_decay=weight_decay, param_groups=param_groups)
        self.plan = plan
        self.engine = DPEngine(model, max_grad_norm=plan.max_grad_norm, strict_float32=plan.strict_float32)
        self.ledger = plan.ledger(earlier_runs)
        self.first_ledger_step = self.ledger.steps  # the earlier runs' steps, counted whole
        self.noise_multiplier = rank_noise_multiplier(plan.noise_multiplier, self.rank)

    @property
    def epsilon(self) -> float:
        return self.ledger.epsilon

    def can_step(self) -> bool:
        return self.ledger.can_step(self.plan.target_epsilon)

    @property
    def counted(self) -> int:
        """This run's steps by its ledger (never behind :attr:`taken`: a step is counted there first), which is what
        the run's charge is settled to."""
        return self.ledger.steps - self.first_ledger_step

    def _gradients(self, inputs: Inputs, loss_fn: LossFn) -> tuple[float, float]:
        """Σ clip(gᵢ, C) of this rank's samples, plus (rank 0 only) the noise, over B; summed over ranks. The step is
        counted before the noised sum exists: a failure after it (a Ctrl-C before the step returns) can overstate ε,
        never leave a step that changed the model uncounted."""
        clipped = self.engine.clipped_sum(noise_multiplier=self.noise_multiplier, noise=self.streams.noise)
        try:
            clipped.add(loss_fn, inputs, physical_batch_size=self.physical_batch_size)
            self._count()
            stats = clipped.privatize(expected_batch_size=self.plan.batch_size, all_reduce=all_reduce_in_place)
        except BaseException:
            clipped.discard()  # a failure before the gradients were set leaves no sum readable in the buffer
            raise
        return all_reduce_sum(stats.loss_sum), all_reduce_sum(stats.examples)

    def _count(self) -> None:
        self.ledger.record_step()  # first: a failure between the two counts can overstate ε, never understate it
        super()._count()

    def _epsilon_of(self) -> Callable[[], float | None]:
        """ε after the step on rank 0 (the other ranks need only :meth:`can_step`)."""
        return functools.partial(self.ledger.epsilon_after, self.ledger.steps) if self.rank == 0 else _no_epsilon

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ledger": self.ledger.state_dict(), "plan": self.plan.to_dict()}

    def load_state_dict(self, state: dict[str, Any], stream_state: dict[str, Any] | None = None) -> None:
        """Continues a checkpointed run of the same plan.

        Raises:
            ValueError: the checkpoint's plan or ledger differs from this plan in N, the data's fingerprint, B,
                q, steps, runs, target, δ, accountant, C, σ, random mode or the other runs composed in (the
                message names the field), or its ledger counts fewer steps than this run's earlier runs and its own
                steps (a checkpoint of an earlier run of the plan).
        """
        mismatch = self.plan.mismatch(state.get("plan") or {})
        if mismatch is None:
            ledger = state.get("ledger") or {}
            mismatch = next((f"ledger {field}={ledger.get(field)!r}, the plan gives {getattr(self.plan, field)!r}"
                             for field in ("noise_multiplier", "sample_rate", "delta", "accountant")
                             if ledger.get(field) != getattr(self.plan, field)), None)
            if mismatch is None and PrivacyLedger.from_state_dict(ledger).prior != self.plan.prior:
                mismatch = "a ledger composed with other runs than the plan's"
        if mismatch is not None:
            raise ValueError(f"resume refused: the checkpoint was trained with {mismatch}")
        ledger_steps, own_steps = int(state["ledger"]["steps"]), int(state["step"])
        if ledger_steps < self.first_ledger_step + own_steps:
            raise ValueError(f"resume refused: the checkpoint's ledger counts {ledger_steps} steps, fewer than this "
                             f"run's earlier runs' {self.first_ledger_step} and its own {own_steps} (a checkpoint "
                             "of an earlier run of the plan?)")
        super().load_state_dict(state, stream_state)
        self.ledger.steps = ledger_steps


class PlainStep(TrainingStep):
    """The DP-off step: the gradient of the mean loss over the realised batch of every rank.

    Args:
        model: the model.
        schedule: the learning-rate schedule.
        seed: the public seed of the run's streams (the run is deterministic for its config).
        local_size: examples in this rank's block.
        sample_rate: q.
        physical_batch_size: microbatch bound (memory only).
        betas: AdamW's moment decays.
        weight_decay: AdamW's decoupled weight decay.
    """

    def __init__(self, model: nn.Module, schedule: Schedule, *, seed: int, local_size: int, sample_rate: float,
                 physical_batch_size: int | None, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.05) -> None:
        rank, _ = rank_and_world()
        super().__init__(model, schedule=schedule, streams=Streams(seed, rank), local_size=local_size,
                         sample_rate=sample_rate, physical_batch_size=physical_batch_size, betas=betas,
                         weight_decay=weight_decay)

    def _gradients(self, inputs: Inputs, loss_fn: LossFn) -> tuple[float, float]:
        loss_sum, examples = 0.0, 0
        for chunk in split_batch(inputs, self.physical_batch_size):
            losses = loss_fn(self.model, chunk)  # losses: [b]
            losses.sum().backward()
            loss_sum += float(losses.detach().sum())
            examples += len(losses)
        self._count()
        params = trainable_parameters(self.model)
        all_reduce_gradients(params)
        count = all_reduce_sum(examples)
        for param in params:
            if param.grad is not None:
                param.grad.div_(max(count, 1.0))
        return all_reduce_sum(loss_sum), count
