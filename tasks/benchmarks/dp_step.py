"""``vip bench dp-step``: one DP-AdamW step of the MAE against the non-private step, in the same process.

Five ways to take one optimiser step on the same MAE and the same batch run interleaved, round after
round, after warm-up (one torch thread by default, which keeps the figures steady on a shared machine):
``nonprivate`` (forward, mean loss backward, AdamW), ``dp`` (this project's private step with q = 1:
Poisson draw, masks and noise from 128-bit-keyed streams, per-sample clipping, DP-AdamW, ledger),
``dp_secure`` (the same in secure mode: every random number from the OS CSPRNG, four-draw Gaussian; skipped
with ``--no-secure``), ``dp_strict`` (with ``--strict-float32``: the same with ``privacy.strict_float32``, IEEE float32
norms and clipped sums instead of the default's bfloat16 operands on the GPU's tensor cores),
``opacus_hooks`` and ``opacus_ghost`` (opacus 1.6.0 ``GradSampleModule`` + ``DPOptimizer``, and ghost
clipping). ``--microbatches K`` makes a step a logical batch of K physical batches of ``--batch`` (the
non-private step accumulates K backward passes; the private step sums K microbatches' clipped gradients),
with the noise and the optimiser step once per logical step, as in a real run. Each time is the median
over the rounds, of
wall-clock time (``*_ratio``) and of this process's CPU time (``*_cpu_ratio``, steadier when other
processes compete for the cores); ``*_ratio_per_round``, ``*_ratio_min`` and ``*_ratio_max`` give the time
ratio's spread: each round's step over the non-private step of the same round. ``--precision bf16`` runs every
mode's forward under bfloat16 autocast.

``work``: for ``nonprivate`` and ``dp``, one step's dispatched operations (``ops``, a ``TorchDispatchMode`` counting
every ATen call, views included), its matmul GFLOP by the precision a GPU runs them in, and the GB its operations
write (:func:`step_work`); ``dp_host_ops_ratio``: what paces a GPU step at small batches, where the host issues
kernels more slowly than the device runs them. Counted on any device, they are the basis of a GPU projection where
no GPU is at hand.

``clip_shortfall``: the mean, over the samples the private step clipped, of ``1 − f·N/C`` (``f`` the clip factor,
``N`` the computed norm): how far the rounding bounds and margins of ``docs/privacy.md``'s rule 12 scale a sample
below ``C``, measured on the benchmark's batch in the benchmark's precision.

Opacus needs the MAE's cls and mask tokens out of the root module (otherwise every opacus mode falls back
to a per-sample vmap of the whole forward, which fails on the random masking): for opacus the same
modules and parameters are re-assembled so that it holds each token in a small
submodule (:func:`opacus_mae`); the computation is the MAE's own. Our engine runs the MAE unmodified.

Peak memory: a ``TorchDispatchMode`` counts the bytes of every tensor storage allocated during one step
and frees them when the storage dies; the peak of that count plus the bytes of the parameters, the
optimiser state and the DP engine's gradient buffer held before the step is the step's peak. It measures tensors, not the allocator or
the Python heap, identically for every mode, and runs apart from the timed rounds (it slows them).

``phases_s``: where a step's time goes, for ``nonprivate`` and ``dp``: the seconds in each range the steps and
the engine label (``forward``; ``backward``, activation gradients only in ``dp``; ``norms``, the per-sample norms and
clip factors; ``clipped_sum``, the clipped sums including ``noise_wait``, the time spent waiting for the helper
threads that draw the noise; ``optimizer``), the median over a few steps run under torch's profiler after the
timed rounds (its overhead included, so they do not add up to the timed medians exactly).

``--device cuda`` runs every mode on the GPU (the images, the models and their optimiser state there; the
naive reference stays on the CPU): each step ends in ``torch.cuda.synchronize()`` before its time is read,
the peak counts the device's tensors the same way, and ``kernels_s`` replaces ``phases_s``: for one
``nonprivate`` and one ``dp`` step, the kernels that take longest, by name, with their device seconds, and the
device span of each ``vip.*`` range, and the kernels' seconds by precision (:func:`kernel_precision`). On a GPU the
engine draws the noise on the device (two Philox generators per tensor), so ``noise_wait`` is absent; the
``noise_ns_per_coordinate_*`` figures stay those of the CPU sampler (the path of CPU training).

``--width W`` sets every encoder and decoder width to ``W`` (one attention head), the preset's depths, patches and
tokens kept: the same layers and operations at so little compute that a step's time is its host's (Python and
kernel dispatch). ``--preset vip-base --img-size 32 --batch 2 --width 48`` on a CPU measures what paces a GPU's
ViP-Base DP step at small batches, where the host's dispatch, not the device, sets the pace.

``nonprivate_cpu_s`` and ``dp_cpu_s``: the median CPU seconds this process spent in a step (every thread). On
a GPU a step whose CPU seconds come near its wall seconds is paced by the host (Python and kernel launches),
not by the device.

``target_ratio``, ``target_peak_mem_ratio`` and ``meets_target``: the DP step's targets on the paper's shapes, time
×1.1 (``vip-nano``) or ×1.2 (``vip-base``) and memory ×1.05 against the non-private step, and whether both were met
(None for another preset, or with ``--width``).

``max_abs_err_vs_naive``: the engine's clipped sum (noise off) against a one-sample-at-a-time autograd
reference on the first samples of the batch, with fixed masks, as the largest absolute difference. This and the
noise sampler's figures below do not depend on the batch size: ``vip bench gpu-check`` measures them at its first
batch size only.

``noise_ns_per_coordinate_one_thread`` and ``noise_ns_per_coordinate_every_core``: the default-mode CPU noise sampler
alone (``GaussianDraw.fill``, the engine's helper-thread path) filling ``NOISE_COORDINATES`` coordinates already in
memory, block by block, on one thread and on ``cores`` threads: the median wall-clock nanoseconds per coordinate.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
import weakref
from typing import Any, Callable, Collection

# The DP step's targets on the paper's shapes (issue 14): time against the non-private step of the same run, and
# peak memory. A preset without one, or one narrowed by --width (other shapes), gets none.
TARGET_RATIOS = {"vip-nano": 1.1, "vip-base": 1.2}
TARGET_PEAK_MEM_RATIO = 1.05
NAIVE_SAMPLES = 8
NOISE_COORDINATES = 1 << 23  # 8 blocks of the sampler
NOISE_ROUNDS = 7  # timed, after one untimed round (the helpers' scratch memory is allocated in it)


def bench_dp_step(
    *, preset: str, img_size: int, batch: int, repeats: int, warmup: int, threads: int, opacus: bool, seed: int,
    precision: str = "fp32", microbatches: int = 1, device: str = "cpu", secure: bool = True,
    strict: bool = False, width: int | None = None, opacus_hooks: bool = True, reference: bool = True,
) -> dict[str, Any]:
    """Times and measures every mode on the MAE of ``preset`` at ``img_size``, a logical step being
    ``microbatches`` physical batches of ``batch``; returns the figures. ``opacus_hooks``: opacus's per-sample hooks
    beside its ghost clipping, where ``opacus``; ``reference``: the figures that do not depend on the batch size
    (the engine against a one-sample-at-a-time reference on the CPU, the CPU noise sampler's speed)."""
    if microbatches > 1 and opacus:
        raise ValueError("--microbatches above 1 times this engine and the non-private step only: add --no-opacus")
    import torch

    from tasks.benchmarks.device import bench_device

    where = bench_device(device)
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook", category=UserWarning)
            return _bench(preset, img_size, batch, repeats, warmup, opacus, seed, precision, microbatches, where,
                          secure, strict, width, opacus_hooks=opacus_hooks, reference=reference)
    finally:
        torch.set_num_threads(previous_threads)


def _bench(preset: str, img_size: int, batch: int, repeats: int, warmup: int, opacus: bool, seed: int,
           precision: str, microbatches: int, device: Any, secure: bool, strict: bool,
           width: int | None, *, opacus_hooks: bool, reference: bool) -> dict[str, Any]:
    import torch

    from vip_core.config import get_preset, with_overrides

    config = get_preset(preset)
    patch = config.model.patch_size
    if img_size % patch:
        raise ValueError(f"--img-size {img_size} is not a multiple of the preset's patch size {patch}")
    config = with_overrides(config, {"model.img_size": img_size, **_narrowed(width)})
    torch.manual_seed(seed)
    images = torch.randn(microbatches * batch, 3, img_size, img_size)  # images: [K*B, 3, S, S]
    steps = _step_functions(config, images.to(device), batch, opacus, precision, secure, strict, opacus_hooks)
    rounds, cpu_rounds = _interleaved_rounds(steps, repeats, warmup)
    seconds, cpu_seconds = _medians(rounds), _medians(cpu_rounds)
    peaks = {name: _peak_bytes(step, state) for name, (step, state) in steps.items()}
    phases = {name: _kernel_seconds(steps[name][0]) if device.type == "cuda" else _phase_medians(steps[name][0], names)
              for name, names in PHASES.items()}
    result: dict[str, Any] = {
        "preset": preset, "img_size": img_size, "width": width, "batch": batch, "microbatches": microbatches,
        "repeats": repeats, "precision": precision, "device": _device_name(device),
        "threads": torch.get_num_threads(),
        "nonprivate_s": seconds["nonprivate"], "dp_s": seconds["dp"],
        "nonprivate_cpu_s": cpu_seconds["nonprivate"], "dp_cpu_s": cpu_seconds["dp"],
        "dp_ratio": seconds["dp"] / seconds["nonprivate"],
        **_round_spread("dp_ratio", rounds["dp"], rounds["nonprivate"]),
        "dp_cpu_ratio": cpu_seconds["dp"] / cpu_seconds["nonprivate"],
        "nonprivate_peak_mb": peaks["nonprivate"] / 2**20, "dp_peak_mb": peaks["dp"] / 2**20,
        "dp_peak_mem_ratio": peaks["dp"] / peaks["nonprivate"],
    }
    work = {name: step_work(steps[name][0]) for name in ("nonprivate", "dp")}
    result["work"] = work
    result["dp_host_ops_ratio"] = work["dp"]["ops"] / work["nonprivate"]["ops"]
    for mode in ("dp_secure", "dp_strict", "opacus_ghost", "opacus_hooks"):
        if mode in seconds:
            result[f"{mode}_s"] = seconds[mode]
            result[f"{mode}_ratio"] = seconds[mode] / seconds["nonprivate"]
            result.update(_round_spread(f"{mode}_ratio", rounds[mode], rounds["nonprivate"]))
            result[f"{mode}_cpu_ratio"] = cpu_seconds[mode] / cpu_seconds["nonprivate"]
            if mode != "dp_secure":
                result[f"{mode}_peak_mem_ratio"] = peaks[mode] / peaks["nonprivate"]
    result["kernels_s" if device.type == "cuda" else "phases_s"] = phases
    result["clip_shortfall"] = clip_shortfall(config, images[:batch].to(device), precision)
    if reference:
        result.update(_reference_figures(config, images))
    result.update(_against_target(preset, width, result))
    if opacus:
        result["opacus_model"] = "the same MAE modules re-assembled with cls/mask tokens in submodules (opacus_mae)"
    return result


def _reference_figures(config: Any, images: Any) -> dict[str, Any]:
    """The figures that do not depend on the batch size: the engine's largest error against a one-sample-at-a-time
    reference (on the CPU), and the CPU noise sampler's speed on one thread and on every core."""
    from vip_core.privacy.buffer import usable_cores

    cores = usable_cores()
    return {"max_abs_err_vs_naive": naive_error(config, images[:NAIVE_SAMPLES]), "cores": cores,
            "noise_ns_per_coordinate_one_thread": noise_ns_per_coordinate(1),
            "noise_ns_per_coordinate_every_core": noise_ns_per_coordinate(cores)}


def _against_target(preset: str, width: int | None, result: dict[str, Any]) -> dict[str, Any]:
    """The preset's targets and whether the step met both (None where the shapes have no target)."""
    target = TARGET_RATIOS.get(preset) if width is None else None
    if target is None:
        return {"target_ratio": None, "target_peak_mem_ratio": None, "meets_target": None}
    met = result["dp_ratio"] <= target and result["dp_peak_mem_ratio"] <= TARGET_PEAK_MEM_RATIO
    return {"target_ratio": target, "target_peak_mem_ratio": TARGET_PEAK_MEM_RATIO, "meets_target": met}


def _narrowed(width: int | None) -> dict[str, int]:
    """The model overrides of ``--width``: every encoder and decoder width ``width``, one attention head each."""
    if width is None:
        return {}
    return {"model.embed_dim": width, "model.num_heads": 1, "model.decoder_embed_dim": width,
            "model.decoder_num_heads": 1}


# ------------------------------------------------------------------------------------------------ the modes

MAX_GRAD_NORM = 1.0
NOISE_MULTIPLIER = 1.0
LR = 1e-4


def _step_functions(config: Any, images: Any, batch: int, opacus: bool, precision: str,
                    secure: bool, strict: bool = False,
                    opacus_hooks: bool = True) -> dict[str, tuple[Callable[[], None], list]]:
    """``name -> (one optimiser step, tensors held between steps)`` for every mode, each on its own copy, with
    its forward in ``precision``."""
    from torch.profiler import record_function

    from vip_core.models.mae import build_mae
    from vip_core.privacy.optimizer import dp_adamw
    from vip_core.train.precision import autocast

    def forward(model: Any, *inputs: Any, **options: Any) -> Any:
        with autocast(precision, images.device):
            return model(*inputs, **options)

    base = build_mae(config.model).to(images.device)
    steps: dict[str, tuple[Callable[[], None], list]] = {}

    plain = copy.deepcopy(base)
    plain_opt = dp_adamw(plain, lr=LR)

    chunks = images.split(batch)

    def nonprivate() -> None:
        for chunk in chunks:  # gradient accumulation over the logical batch
            with record_function("vip.forward"):
                loss = forward(plain, chunk)[0].float().sum() / images.shape[0]
            with record_function("vip.backward"):
                loss.backward()
        with record_function("vip.optimizer"):
            plain_opt.step()
            plain_opt.zero_grad(set_to_none=True)

    steps["nonprivate"] = (nonprivate, [plain, plain_opt])

    steps["dp"] = _private_step(base, images, batch, forward, secure=False)
    if secure:
        steps["dp_secure"] = _private_step(base, images, batch, forward, secure=True)
    if strict:
        steps["dp_strict"] = _private_step(base, images, batch, forward, secure=False, strict=True)
    if opacus:
        steps["opacus_ghost"] = _opacus_step(base, images, forward, ghost=True)
    if opacus and opacus_hooks:
        steps["opacus_hooks"] = _opacus_step(base, images, forward, ghost=False)
    if images.device.type == "cuda":
        steps = {name: (_synchronized(step, images.device), held) for name, (step, held) in steps.items()}
    return steps


def _synchronized(step: Callable[[], None], device: Any) -> Callable[[], None]:
    """``step`` that returns once the GPU has run every kernel it launched (a step's time is its kernels')."""
    from tasks.benchmarks.device import finish

    def run() -> None:
        step()
        finish(device)

    return run


def _device_name(device: Any) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _private_step(base: Any, images: Any, physical: int, forward: Callable, *,
                  secure: bool, strict: bool = False) -> tuple[Callable[[], None], list]:
    """vip's private step (:class:`~vip_core.train.step.PrivateStep`) with q = 1, so that every image is in
    every step, in microbatches of ``physical``: Poisson draw, masks and noise from its random streams,
    clipping, DP-AdamW, ledger."""
    from vip_core.config import PrivacyConfig
    from vip_core.privacy.plan import plan_privacy
    from vip_core.train.schedule import Schedule
    from vip_core.train.step import PrivateStep

    model = copy.deepcopy(base)
    batch = images.shape[0]
    budget = PrivacyConfig(noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM, target_epsilon=1e9,
                           delta=1e-5, accountant="rdp", secure_mode=secure, strict_float32=strict)
    plan = plan_privacy(budget, dataset_size=batch, batch_size=batch, steps=10_000, fingerprint="bench")
    step = PrivateStep(model, plan, Schedule(peak_lr=LR, total_steps=10_000, kind="constant"),
                       physical_batch_size=physical)

    def batch_of(local: Any, stream: Any) -> tuple[Any, Any]:
        return images[local], stream.uniform((len(local), model.num_patches))  # [b, 3, S, S], [b, L]

    def loss(mae: Any, inputs: tuple[Any, Any]) -> Any:  # one function for every step: checked once by the engine
        return forward(mae, inputs[0], noise=inputs[1].to(images.device))[0].float()  # [b]

    def run() -> None:
        step(batch_of, loss)

    return run, [model, step.optimizer, step.engine]


def _opacus_step(base: Any, images: Any, forward: Callable, *, ghost: bool) -> tuple[Callable[[], None], list]:
    import torch
    from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    wrapped = opacus_mae(copy.deepcopy(base))
    adamw = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=LR)
    common = dict(noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM, expected_batch_size=images.shape[0])
    if ghost:
        module = GradSampleModuleFastGradientClipping(
            wrapped, loss_reduction="sum", max_grad_norm=MAX_GRAD_NORM, use_ghost_clipping=True
        )
        optimizer = DPOptimizerFastGradientClipping(adamw, loss_reduction="sum", **common)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            DPTensorFastGradientClipping(module, optimizer, forward(module, images).float(), "sum").backward()
            optimizer.step()
    else:
        module = GradSampleModule(wrapped, loss_reduction="sum")
        optimizer = DPOptimizer(adamw, loss_reduction="sum", **common)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            forward(module, images).float().sum().backward()
            optimizer.step()

    return step, [wrapped, optimizer.original_optimizer]


def _token_holders() -> tuple[type, type]:
    """Submodules with one tensor input each (opacus vmaps a module over its first input only)."""
    import torch
    from torch import nn

    class ClassToken(nn.Module):
        """Prepends the class token to the visible tokens."""

        def __init__(self, token: nn.Parameter) -> None:
            super().__init__()
            self.token = token

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.token.expand(x.shape[0], -1, -1), x], dim=1)  # [N, 1 + len_keep, D]

    class MaskTokens(nn.Module):
        """Appends one mask token per masked patch after the visible patch tokens (class token dropped)."""

        def __init__(self, token: nn.Parameter, num_patches: int) -> None:
            super().__init__()
            self.token = token
            self.num_patches = num_patches

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n, visible, _ = x.shape
            masked = self.token.expand(n, self.num_patches + 1 - visible, -1)  # masked: [N, L - len_keep, Dd]
            return torch.cat([x[:, 1:, :], masked], dim=1)  # [N, L, Dd], in noise order

    return ClassToken, MaskTokens


def opacus_mae(mae: Any) -> Any:
    """The MAE's own modules and parameters, with the tokens held by submodules so that opacus hooks
    every layer instead of vmapping the whole forward. ``forward(imgs) -> [N]`` losses."""
    import torch
    from torch import nn

    class_token, mask_tokens = _token_holders()

    class _OpacusMAE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch_embed, self.blocks, self.norm = mae.patch_embed, mae.blocks, mae.norm
            self.decoder_embed, self.decoder_blocks = mae.decoder_embed, mae.decoder_blocks
            self.decoder_norm, self.decoder_pred = mae.decoder_norm, mae.decoder_pred
            self.cls = class_token(mae.cls_token)
            self.mask = mask_tokens(mae.mask_token, mae.num_patches)
            self.mae_functions = [mae]  # a list: not a submodule, so its root parameters are not seen twice

        def forward(self, imgs: torch.Tensor) -> torch.Tensor:
            core = self.mae_functions[0]
            x = self.patch_embed(imgs) + core.pos_embed[:, 1:, :]  # x: [N, L, D]
            x, mask, ids_restore = core.random_masking(x, core.mask_ratio, core.masking_noise(imgs.shape[0]))
            x = self.cls(x)  # x: [N, 1 + len_keep, D]
            x = torch.cat([x[:, :1, :] + core.pos_embed[:, :1, :], x[:, 1:, :]], dim=1)
            for block in self.blocks:
                x = block(x)
            x = self.decoder_embed(self.norm(x))  # x: [N, 1 + len_keep, Dd]
            patches = self.mask(x)  # patches: [N, L, Dd]
            dim = patches.shape[-1]
            patches = torch.gather(patches, 1, ids_restore.unsqueeze(-1).expand(-1, -1, dim))  # image order
            x = torch.cat([x[:, :1, :], patches], dim=1) + core.decoder_pos_embed  # x: [N, 1 + L, Dd]
            for block in self.decoder_blocks:
                x = block(x)
            pred = self.decoder_pred(self.decoder_norm(x))[:, 1:, :]  # pred: [N, L, p*p*3]
            return core.forward_loss(imgs, pred, mask)  # [N]

    return _OpacusMAE()


# ------------------------------------------------------------------------------------------------ measuring


def _interleaved_rounds(
    steps: dict[str, tuple[Callable[[], None], list]], repeats: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Runs the modes in turn (A, B, C, A, B, C, ...); each one's wall and CPU seconds per step, round by round."""
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for round_index in range(warmup + repeats):
        for name, (step, _) in steps.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            if round_index >= warmup:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def _medians(rounds: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in rounds.items()}


def _round_spread(key: str, mode_seconds: list[float], baseline_seconds: list[float]) -> dict[str, Any]:
    """The spread of a ratio: each round's mode step over the non-private step of the same round (run just before it),
    and their least and greatest."""
    per_round = [round(mode / baseline, 4) for mode, baseline in zip(mode_seconds, baseline_seconds)]
    return {f"{key}_per_round": per_round, f"{key}_min": min(per_round), f"{key}_max": max(per_round)}


PROFILED_ROUNDS = 3


PHASES = {"nonprivate": ("forward", "backward", "optimizer"),
          "dp": ("forward", "backward", "norms", "clipped_sum", "noise_wait", "optimizer")}


def _phase_medians(step: Callable[[], None], phases: tuple[str, ...]) -> dict[str, float]:
    """Seconds in each ``vip.*`` phase of one step (the ranges the engine and the steps label: forward,
    backward, norms, clipped_sum with the noise_wait inside it, optimizer; 0 for one a step never entered, such as
    noise_wait when the noise was drawn before it was needed), the median over ``PROFILED_ROUNDS`` steps run under
    torch's profiler (whose own overhead they include)."""
    from torch.profiler import ProfilerActivity, profile

    rounds: list[dict[str, float]] = []
    for _ in range(PROFILED_ROUNDS):
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            step()
        rounds.append({event.key.removeprefix("vip."): event.cpu_time_total / 1e6
                       for event in profiler.key_averages() if event.key.startswith("vip.")})
    return {name: statistics.median(r.get(name, 0.0) for r in rounds) for name in sorted(set(phases).union(*rounds))}


TOP_KERNELS = 12


def _kernel_seconds(step: Callable[[], None]) -> dict[str, dict[str, float]]:
    """One step under torch's profiler on the GPU: ``kernels``, the ``TOP_KERNELS`` kernels (and copies) that
    take longest, by name, with their device seconds, and ``"all"``, every kernel's; ``ranges``, the device span
    of each ``vip.*`` range (from its first kernel's start to its last kernel's end, summed over the range's
    calls: the spans include the gaps between kernels and can overlap one another)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as profiler:
        step()
    launched_on = _launching_dtypes(profiler.events())
    ranges, kernels = [], []
    for event in profiler.key_averages():
        if event.device_type == DeviceType.CUDA:
            (ranges if getattr(event, "is_user_annotation", False) else kernels).append(event)
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    seconds = {e.key[:80]: e.self_device_time_total / 1e6 for e in kernels[:TOP_KERNELS]}
    seconds["all"] = sum(e.self_device_time_total for e in kernels) / 1e6
    spans = {e.key.removeprefix("vip."): e.device_time_total / 1e6 for e in ranges if e.key.startswith("vip.")}
    by_precision: dict[str, float] = {}
    for event in kernels:
        kind = kernel_precision(event.key, launched_on.get(event.key, ()))
        by_precision[kind] = by_precision.get(kind, 0.0) + event.self_device_time_total / 1e6
    return {"kernels": seconds, "ranges": spans, "by_precision": by_precision}


def _launching_dtypes(events: Any) -> dict[str, set[str]]:
    """Each kernel's name, with the input dtypes of the operators that launched it (torch's profiler attaches a
    kernel to the operator whose launch it correlates with; shapes and dtypes are recorded with ``record_shapes``)."""
    dtypes: dict[str, set[str]] = {}
    for event in events:
        for kernel in event.kernels:
            dtypes.setdefault(kernel.name, set()).update(getattr(event, "input_dtypes", None) or ())
    return dtypes


_MATMUL_WORDS = ("gemm", "matmul", "xmma", "cutlass", "wgmma", "sm90_", "nvjet", "flash", "fmha")
_PRECISION_MARKERS = (("bf16", "matmul_bf16"), ("bfloat16", "matmul_bf16"), ("tf32", "matmul_tf32"),
                      ("f16", "matmul_fp16"), ("h16", "matmul_fp16"), ("half_t", "matmul_fp16"),
                      ("s1688", "matmul_tf32"))
_DTYPE_KINDS = {"c10::BFloat16": "matmul_bf16", "c10::Half": "matmul_fp16"}


def kernel_precision(name: str, launched_on: Collection[str] = ()) -> str:
    """A CUDA kernel's kind: ``matmul_bf16`` and ``matmul_fp16`` (tensor cores), ``matmul_tf32``, ``matmul_fp32``
    (IEEE float32 on CUDA cores), or ``other`` (elementwise, reductions, copies). From its name, and where the name
    gives no precision (cuBLAS's ``nvjet`` kernels), from ``launched_on``, the input dtypes of the operators that
    launched it."""
    lowered = name.lower()
    if not any(word in lowered for word in _MATMUL_WORDS):
        return "other"
    for marker, kind in _PRECISION_MARKERS:
        if marker in lowered:
            return kind
    for dtype, kind in _DTYPE_KINDS.items():
        if dtype in launched_on:
            return kind
    return "matmul_fp32"


# each matmul's operands (by position); ``bmm.dtype`` is the engine's tensor-core product (bfloat16 in, float32 out)
_MATMULS = {"aten.mm.default": (0, 1), "aten.bmm.default": (0, 1), "aten.bmm.dtype": (0, 1),
            "aten.addmm.default": (1, 2), "aten.baddbmm.default": (1, 2)}


def step_work(step: Callable[[], None]) -> dict[str, float]:
    """What one call of ``step`` asks of the device: ``ops``, the ATen operations it dispatches (views and in-place
    updates included: each is a trip through the host's dispatcher, and most launch a kernel on a GPU);
    ``matmul_gflop_bf16`` and ``matmul_gflop_fp32``, its matmuls' GFLOP by the precision a GPU would run them in
    (bfloat16 operands, or float32 copies of bfloat16 tensors, which the engine multiplies on tensor cores there; and
    float32); ``written_gb``, the bytes its operations write into new or updated tensors, views left out (a proxy
    for the memory traffic of everything else)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    work = {"ops": 0, "matmul_gflop_bf16": 0.0, "matmul_gflop_fp32": 0.0, "written_gb": 0.0}
    copies_of_bf16: set[int] = set()  # float32 tensors that hold exact copies of bfloat16 ones

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            work["ops"] += 1
            name = str(func)
            if name == "aten._to_copy.default" and args[0].dtype == torch.bfloat16 and out.dtype == torch.float32:
                copies_of_bf16.add(id(out))
            if name in _MATMULS:
                left, right = (args[i] for i in _MATMULS[name])
                flops = 2 * left.numel() * right.shape[-1] / 1e9
                low = all(t.dtype == torch.bfloat16 or id(t) in copies_of_bf16 for t in (left, right))
                work["matmul_gflop_bf16" if low else "matmul_gflop_fp32"] += flops
            read = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            in_place = name.split(".")[0].endswith("_")
            work["written_gb"] += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                                      if isinstance(t, torch.Tensor)
                                      and (in_place or t.untyped_storage().data_ptr() not in read)) / 1e9
            return out

    from vip_core.privacy.buffer import usable_cores

    threads = torch.get_num_threads()
    torch.set_num_threads(usable_cores())  # no idle core: the engine's work stays on this thread, where it is counted
    try:
        with Count():
            step()
    finally:
        torch.set_num_threads(threads)
    return work


def _peak_bytes(step: Callable[[], None], held: list) -> int:
    """Bytes held before the step (parameters, optimiser state) plus the peak of the step's own tensors."""
    counter = _live_tensor_bytes_class()()
    with counter:
        step()
    return _held_bytes(held) + counter.peak


def _held_bytes(objects: list) -> int:
    import torch

    from vip_core.privacy.engine import DPEngine

    storages: dict[int, int] = {}
    for obj in objects:
        if isinstance(obj, DPEngine):  # its gradient buffer is kept from step to step
            tensors = list(obj.buffer.flats.values())
        else:
            tensors = list(obj.parameters()) if isinstance(obj, torch.nn.Module) else _optimizer_tensors(obj)
        for tensor in tensors:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def _optimizer_tensors(optimizer: Any) -> list:
    import torch

    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _live_tensor_bytes_class() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveTensorBytes(TorchDispatchMode):
        """Counts the bytes of tensor storages created while active, until each storage is freed."""

        def __init__(self) -> None:
            super().__init__()
            self.live = 0
            self.peak = 0
            self.sizes: dict[int, int] = {}

        def _free(self, key: int) -> None:
            self.live -= self.sizes.pop(key)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            for tensor in tree_leaves(out):
                if hasattr(tensor, "untyped_storage"):
                    storage = tensor.untyped_storage()
                    key = id(storage)
                    if key not in self.sizes and storage.nbytes():
                        self.sizes[key] = storage.nbytes()
                        self.live += storage.nbytes()
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(storage, self._free, key)
            return out

    return LiveTensorBytes




def noise_ns_per_coordinate(threads: int) -> float:
    """Median nanoseconds per coordinate of the default CPU noise sampler on ``threads`` threads, one block per task."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from vip_core.privacy.randomness import GaussianDraw, RandomStream

    buffer = torch.zeros(NOISE_COORDINATES)  # already in memory: the sampler alone, no page faults
    draw = GaussianDraw(RandomStream(0, 0, "noise"), 1.0)
    blocks = list(GaussianDraw.blocks(buffer.numel()))
    seconds = []
    with ThreadPoolExecutor(threads, "bench-noise") as pool:
        for _ in range(1 + NOISE_ROUNDS):
            start = time.perf_counter()
            list(pool.map(lambda block: draw.fill(0, buffer, block), blocks))
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:]) / buffer.numel() * 1e9


def naive_error(config: Any, images: Any) -> float:
    """Largest absolute difference between the engine's clipped sum and a one-at-a-time reference."""
    import torch

    from vip_core.models.mae import build_mae
    from vip_core.privacy.engine import privatized_gradients

    mae = build_mae(config.model)
    noise = torch.rand(images.shape[0], config.model.num_patches, generator=torch.Generator().manual_seed(3))
    params = [p for p in mae.parameters() if p.requires_grad]
    reference = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for i in range(images.shape[0]):
        grads = torch.autograd.grad(mae(images[i : i + 1], noise=noise[i : i + 1])[0].sum(), params)
        norm = float(torch.sqrt(sum(g.double().square().sum() for g in grads)))
        factor = min(1.0, MAX_GRAD_NORM / (norm + 1e-6))
        for acc, grad in zip(reference, grads):
            acc += factor * grad.double()
    privatized_gradients(
        mae, lambda model, inp: model(inp[0], noise=inp[1])[0], (images, noise), max_grad_norm=MAX_GRAD_NORM,
        noise_multiplier=0.0, expected_batch_size=1.0,
    )
    return max(float((p.grad.double() - r).abs().max()) for p, r in zip(params, reference))


def clip_shortfall(config: Any, images: Any, precision: str) -> float:
    """The mean clip-factor shortfall (:class:`~vip_core.privacy.engine.StepStats`) of the engine on ``images``
    with fixed masks, its forward in ``precision``."""
    import torch

    from vip_core.models.mae import build_mae
    from vip_core.privacy.engine import privatized_gradients
    from vip_core.train.precision import autocast

    mae = build_mae(config.model).to(images.device)
    noise = torch.rand(images.shape[0], config.model.num_patches, generator=torch.Generator().manual_seed(3))

    def loss(model: Any, inputs: tuple[Any, Any]) -> Any:
        with autocast(precision, images.device):
            return model(inputs[0], noise=inputs[1])[0].float()

    stats = privatized_gradients(mae, loss, (images, noise.to(images.device)), max_grad_norm=MAX_GRAD_NORM,
                                 noise_multiplier=0.0, expected_batch_size=1.0)
    return stats.shortfall
