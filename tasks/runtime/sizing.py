"""What a run will cost, said before it starts: images to render and ingest, training steps, and the time expected
on this machine's devices, from rates the benchmarks measured (:data:`MEASURED`).

The estimate counts rendering, ingestion and the two pre-training stages; evaluation comes on top, as the line says.
It is a guide to orders of magnitude, not a promise: the rates were measured on particular machines. A training step
costs the MAE's arithmetic per image (:func:`mae_train_flops`) at the device's measured rate, plus a fixed per-step
cost. A run with no GPU here that would take longer than :data:`CPU_DEMO_LIMIT_S` asks for confirmation
(:func:`confirm`): such a run (the paper's presets) is for GPUs.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from vip_core.config import ModelConfig, TrainingConfig, VipConfig

CPU_DEMO_LIMIT_S = 2 * 3600.0

# Measured rates: the commands, machines and runs are in docs/performance.md, docs/scaling.md (the paper's run),
# docs/rendering.md and CHANGELOG.md (the CPU's ViP-Base step, measured on 4 December 2026).
MEASURED = {
    # `vip bench dp-step --preset vip-base --img-size 224 --batch 4 --threads 2`, 2-core AVX-512 EPYC: DP images/s,
    # and DP / non-private step time; the fixed cost of a step: an MAE of the tiny preset's size at batch 64,
    # 32 px, whose arithmetic is a few percent of its 130 ms step.
    "cpu": {"dp_images_per_s_vip_base": 2.04, "dp_slowdown": 1.38, "step_overhead_s": 0.13, "cores": 2},
    # `vip bench dp-step --device cuda --preset vip-base --img-size 224 --batch 512 --precision bf16`, one H200.
    "cuda": {"dp_images_per_s_vip_base": 1240.0, "dp_slowdown": 4.26, "step_overhead_s": 0.05},
    # `vip bench render`, Mesa llvmpipe, 16 images per program, one worker: seconds per image = a + b * pixels
    # (13.2 images/s at 64 px, 8.0 at 256 px; GL on a GPU is faster).
    "render": {"seconds_per_image": 0.0725, "seconds_per_pixel": 8.0e-7},
    # `vip bench ingest --image-size 256`: images cleaned per CPU-second; img2dataset's own figure for the download
    # of one node (this machine reaches 127.0.0.1 only).
    "ingest": {"images_per_cpu_s": 210.0, "downloads_per_s": 1000.0},
    # `make run` of the tiny preset from a fresh clone, this machine: its flow began 24 s after the command (imports,
    # a temporary Prefect server, the demo's evaluation data), and each training stage took 22-27 s beyond its steps
    # (a local Ray and its worker group).
    "start_up": {"run_s": 24.0, "training_stage_s": 22.0},
}


@dataclass(frozen=True)
class Devices:
    """What this machine trains on: its CPU cores and its NVIDIA GPUs."""

    cores: int
    gpus: int

    @classmethod
    def here(cls) -> "Devices":
        """Counted without importing torch: the driver lists one folder per GPU."""
        gpus = Path("/proc/driver/nvidia/gpus")
        return cls(cores=os.cpu_count() or 1, gpus=len(list(gpus.iterdir())) if gpus.is_dir() else 0)

    def describe(self) -> str:
        return f"{self.gpus} GPU{'s' * (self.gpus != 1)}" if self.gpus else f"CPU, {self.cores} cores, no GPU"


@dataclass(frozen=True)
class Part:
    """One stage's work: what it counts (``"10,000 steps of 4,096"``) and the seconds expected."""

    stage: str
    amount: str
    seconds: float
    done: bool = False


@dataclass(frozen=True)
class RunSize:
    """The parts of a run and the devices they were sized for."""

    parts: tuple[Part, ...]
    devices: Devices
    evaluation: bool = False  # the run evaluates too, which is not sized

    @property
    def seconds(self) -> float:
        return sum(part.seconds for part in self.parts)

    def needs_confirmation(self) -> bool:
        """Far beyond a CPU demo: no GPU here and more than :data:`CPU_DEMO_LIMIT_S` expected."""
        return not self.devices.gpus and self.seconds > CPU_DEMO_LIMIT_S

    def line(self) -> str:
        """The one line said before the run starts."""
        work = ", ".join(part.stage + (" done" if part.done else f" {part.amount} ({duration(part.seconds)})")
                         for part in self.parts)
        evaluation = ", then evaluation (not sized)" if self.evaluation else ""
        return (f"size: {work or 'nothing to do'}; expected on this machine ({self.devices.describe()}): "
                f"{duration(self.seconds)}{evaluation} (measured rates, tasks/runtime/sizing.py)")


def size_run(config: VipConfig, stages: tuple[str, ...], *, ingest_rows: int | None,
             done: set[str] = frozenset(), devices: Devices | None = None, evaluation: bool = False) -> RunSize:
    """The work of ``stages`` (of ``ingest``, ``render``, ``pretrain-syn``, ``pretrain-dp``; others are not
    counted) for ``config``, those in ``done`` finished already; ``ingest_rows``: the url list's rows, None when
    unknown; ``evaluation``: the run evaluates afterwards (the line says it is not sized)."""
    devices = devices or Devices.here()
    parts = [Part(stage, "finished", 0.0, done=True) for stage in stages if stage in done]
    stages = tuple(stage for stage in stages if stage not in done)
    if "render" in stages:
        parts.append(render_part(config, devices))
    if "ingest" in stages and ingest_rows is not None:
        parts.append(ingest_part(ingest_rows, devices))
    for stage, training, private in (("pretrain-syn", config.synthetic, False), ("pretrain-dp", config.private, True)):
        if stage in stages:
            parts.append(training_part(stage, config.model, training, private, devices))
    if stages:
        parts.append(Part("start-up", "of processes and servers", MEASURED["start_up"]["run_s"]))
    return RunSize(tuple(parts), devices, evaluation)


def url_list_rows(url_list: str) -> int | None:
    """The rows of a local parquet, csv or jsonl url list (read from the parquet footer, else counted); None for a
    URL or a file that cannot be read (ingestion then says what is wrong)."""
    path = Path(url_list)
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
        with open(path, "rb") as lines:
            return sum(1 for _ in lines) - (path.suffix == ".csv")
    except (OSError, ValueError):
        return None


def render_part(config: VipConfig, devices: Devices) -> Part:
    render = config.data.render
    rate = MEASURED["render"]
    seconds = render.num_images * (rate["seconds_per_image"] + rate["seconds_per_pixel"] * render.size**2)
    return Part("render", f"{render.num_images:,} images at {render.size} px",
                seconds / min(render.workers, devices.cores))


def ingest_part(rows: int, devices: Devices) -> Part:
    rate = MEASURED["ingest"]
    return Part("ingest", f"{rows:,} url-list rows",
                rows / min(rate["downloads_per_s"], rate["images_per_cpu_s"] * devices.cores))


def training_part(stage: str, model: ModelConfig, training: TrainingConfig, private: bool, devices: Devices) -> Part:
    """``training.steps`` steps of ``training.batch_size`` images (the expected batch of a private step)."""
    device = "cuda" if devices.gpus else "cpu"
    rate = MEASURED[device]
    dp_flops_per_s = rate["dp_images_per_s_vip_base"] * mae_train_flops(_VIP_BASE)
    if device == "cuda":
        dp_flops_per_s *= min(training.num_workers, devices.gpus)
    else:
        dp_flops_per_s *= devices.cores / rate["cores"]
    flops_per_s = dp_flops_per_s if private else dp_flops_per_s * rate["dp_slowdown"]
    step_s = rate["step_overhead_s"] + training.batch_size * mae_train_flops(model) / flops_per_s
    return Part(stage, f"{training.steps:,} steps of {training.batch_size:,} images",
                MEASURED["start_up"]["training_stage_s"] + training.steps * step_s)


def mae_train_flops(model: ModelConfig) -> float:
    """Floating-point operations of one image's forward and backward through the MAE (3 x the forward): the
    encoder's blocks on the kept patches and the class token, the decoder's on every patch and the class token."""
    kept = int(model.num_patches * (1 - model.mask_ratio)) + 1
    encoder = model.depth * _block_flops(kept, model.embed_dim, model.mlp_ratio)
    decoder = model.decoder_depth * _block_flops(model.num_patches + 1, model.decoder_embed_dim, model.mlp_ratio)
    patch_pixels = model.patch_size**2 * model.in_chans
    ends = 2 * model.num_patches * patch_pixels * (model.embed_dim + model.decoder_embed_dim)  # embed, predict
    return 3.0 * (encoder + decoder + ends)


def _block_flops(tokens: int, width: int, mlp_ratio: float) -> float:
    """A transformer block's forward: projections and MLP (2 FLOPs a multiply-add) and attention's two products."""
    return 2 * tokens * width**2 * (4 + 2 * mlp_ratio) + 4 * tokens**2 * width


_VIP_BASE = ModelConfig(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                        decoder_embed_dim=512, decoder_depth=4, decoder_num_heads=16)


def duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``, ``41 days``, ``9.6 years``."""
    for unit, length in (("years", 365 * 86400), ("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * length:
            value = seconds / length
            return f"{value:.1f} {unit}" if value < 10 else f"{value:,.0f} {unit}"
    return f"{max(1, math.ceil(seconds))} s"


def confirm(size: RunSize, *, yes: bool, flag: str) -> str | None:
    """None when the run may start: small enough, ``yes`` given, or the person at the terminal said so; else the
    one line that stops it, naming ``flag`` (``--yes`` or ``YES=1``)."""
    if yes or not size.needs_confirmation():
        return None
    question = f"this run needs about {duration(size.seconds)} on this machine, which has no GPU"
    if sys.stdin.isatty():
        print(f"{question}. Start it anyway? [y/N] ", end="", flush=True)
        if sys.stdin.readline().strip().lower() in ("y", "yes"):
            return None
    return f"{question}; not started: pass {flag} to start it anyway"
