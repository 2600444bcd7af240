"""``vip bench train``: a full DP pre-training step reading real shards through the input pipeline, against
the same step on images already in memory, and the input pipeline alone, in one process.

``--images`` JPEG photographs of ``--source-side`` px (LAION-like, from the sample photographs) are written
to webdataset shards in a temporary folder. Two copies of one MAE (``--preset``, at ``--img-size``) each take
DP-AdamW steps (:class:`~vip_core.train.step.PrivateStep`: Poisson sampling at q = batch / images, clipping,
noise, ledger) with the pre-training worker's loss (uint8 images normalised at step time, masks from the
step's per-sample stream, the forward in ``--precision``):

* ``in_memory``: every image decoded once beforehand; a step indexes the uint8 tensor.
* ``shards``: the same sequence of Poisson samples (the in-memory side's sampler state, copied), each drawn
  ``--ahead`` steps in advance and decoded from the shards by ``--decode-workers`` processes or threads
  (``--decode-mode``) while earlier steps run (:class:`~vip_core.train.pipeline.InputPipeline`), with the
  Ray worker's defaults (its mode; one decoder per CPU of the preset's private stage, at least two). Each
  block starts cold (the draws made ahead are dropped between blocks; the decoders stay up), as a run does
  once.

The sides alternate in blocks of ``--steps`` timed steps, ``--rounds`` times, after ``--warmup`` untimed steps
of each, the side that goes first alternating too (in-memory, shards; shards, in-memory; ...): both sides take
the same samples, and on a GPU a step at a sample size not seen before pays about 0.25 s more (measured on an
H200 at ViP-Base shapes), which the side going second would never pay. Each block's first ``--ahead`` + 1
steps are untimed on both sides (the shards side waits there for its first sample's decoding, a cost a run
pays once, not every ``--steps`` steps, and decodes the next samples while no step runs); images/s is
realised images over wall time.
``input_ratio`` = shards / in-memory over all timed blocks (target >= 0.95), with each round's own ratio beside it
(``input_ratio_per_round``, ``input_ratio_min``, ``input_ratio_max``): its spread. ``loader_images_per_s_per_proc``: the pipeline's decode
alone (read, JPEG draft decode, resize, uint8) on one thread over every image. On a shared machine the figures
are noisy: the load average is printed with them.

``--device cuda``: both models train on the GPU, each step's images copied from pinned host memory at step time
(the pipeline pins what it decodes, as the pre-training worker does with ``use_gpu``, and the in-memory side
pins each step's gather, so that the sides differ only in where the images come from); each block's
time ends with the GPU's last kernel.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_INPUT_RATIO = 0.95
NOISE_MULTIPLIER = 1.0
LR = 1e-4


def bench_train(*, preset: str, img_size: int | None, batch: int, images: int, source_side: int, steps: int,
                rounds: int, warmup: int, threads: int, decode_workers: int | None, decode_mode: str | None,
                ahead: int, precision: str, seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """Images/s of the DP step from shards and from memory, and of the loader alone; see the module."""
    import torch

    from tasks.benchmarks.device import bench_device
    from vip_core.config import get_preset, with_overrides
    from vip_core.train.data import ShardPartition, measure_shards
    from vip_core.train.pipeline import DECODE_MODE
    from vip_core.train.pipeline import decode_workers as default_decode_workers

    where = bench_device(device)
    if batch > images:
        raise ValueError(f"--batch {batch} exceeds the {images} images")
    config = get_preset(preset)
    if img_size is not None:
        config = with_overrides(config, {"model.img_size": img_size})
    if decode_workers is None:
        decode_workers = default_decode_workers(config.private.cpus_per_worker)
    decode_mode = decode_mode or DECODE_MODE
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory(prefix="vip-bench-train-") as folder:
            shards = measure_shards(_write_photos(Path(folder), images, source_side))
            partition = ShardPartition(shards.shards, shards.counts, 0, 1, config.model.img_size)
            started = time.perf_counter()
            memory = partition.decode(torch.arange(len(partition))).pixels  # memory: [N, 3, S, S] uint8
            loader_rate = len(partition) / (time.perf_counter() - started)
            blocks = _interleaved(config, partition, memory, batch=batch, steps=steps, rounds=rounds, warmup=warmup,
                                  decode_workers=decode_workers, decode_mode=decode_mode, ahead=ahead,
                                  precision=precision, seed=seed, device=where)
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous_threads)
    rates = {name: _rate(side) for name, side in blocks.items()}
    ratio = rates["shards"] / rates["in_memory"]
    per_round = _round_ratios(blocks)
    return {
        "benchmark": "train", "preset": preset, "device": device, "img_size": config.model.img_size, "batch": batch,
        "images": images, "source_side": source_side, "precision": precision, "steps": steps, "rounds": rounds,
        "torch_threads": used_threads, "decode_mode": decode_mode, "decode_workers": decode_workers,
        "ahead": ahead, "untimed_steps_per_block": ahead + 1,
        "step_images_per_s": round(rates["shards"], 2), "in_memory_images_per_s": round(rates["in_memory"], 2),
        "input_ratio": round(ratio, 4), "input_ratio_per_round": [round(r, 4) for r in per_round],
        "input_ratio_min": round(min(per_round), 4), "input_ratio_max": round(max(per_round), 4),
        "loader_images_per_s_per_proc": round(loader_rate, 1),
        "target_input_ratio": TARGET_INPUT_RATIO, "meets_target": ratio >= TARGET_INPUT_RATIO,
        "load_average": round(os.getloadavg()[0], 2),
    }


def _write_photos(folder: Path, count: int, side: int) -> Path:
    from tasks.fixtures.web import sample_photo
    from vip_core.data.shards import ShardWriter, encode_image

    shards = folder / "shards"
    with ShardWriter(shards, prefix="web", samples_per_shard=256) as writer:
        for index in range(count):
            photo = sample_photo(index, side).resize((side, side))
            writer.write(f"{index:06d}", {"jpg": encode_image(photo, "jpg", quality=90)})
    return shards


def _interleaved(config: Any, partition: Any, memory: Any, *, batch: int, steps: int, rounds: int, warmup: int,
                 decode_workers: int, decode_mode: str, ahead: int, precision: str, seed: int,
                 device: Any) -> dict[str, list[tuple[int, float]]]:
    """The ``(images, seconds)`` of each side's timed blocks, one a round."""
    import torch

    from tasks.benchmarks.device import finish
    from vip_core.models.mae import build_mae

    torch.manual_seed(seed)
    base = build_mae(config.model).to(device)
    in_memory, shards = _private_step(base, config, len(memory), batch), _private_step(base, config, len(memory), batch)
    pipeline = shards.prefetch(partition.decode, ahead=ahead, workers=decode_workers, mode=decode_mode,
                               pin_memory=device.type == "cuda")
    pipeline.load_state_dict(in_memory.sampler.state_dict())  # the same Poisson samples on both sides
    gather = (lambda local: memory[local].pin_memory()) if device.type == "cuda" else (lambda local: memory[local])
    sources = {"in_memory": (in_memory, gather), "shards": (shards, lambda local: pipeline.pixels(local).pixels)}
    loss = _mae_loss(precision)
    blocks: dict[str, list[tuple[int, float]]] = {name: [] for name in sources}  # (images, seconds) of each block
    for attempt in range(rounds):
        for name, (step, pixels) in _ordered(sources, attempt):
            # untimed: the warm-up, then each block's first ahead + 1 steps (the pipeline starts cold once per
            # run, and at every block here; the timed steps' samples are all drawn while steps run)
            _block(step, pixels, loss, (warmup if attempt == 0 else 0) + ahead + 1)
            finish(device)
            started = time.perf_counter()
            images = _block(step, pixels, loss, steps)
            finish(device)
            blocks[name].append((images, time.perf_counter() - started))
            if name == "shards":
                pipeline.load_state_dict(pipeline.state_dict())  # the next block starts cold
    pipeline.close()
    return blocks


def _rate(blocks: list[tuple[int, float]]) -> float:
    """Images/s over ``blocks`` of ``(images, seconds)``."""
    return sum(images for images, _ in blocks) / sum(seconds for _, seconds in blocks)


def _round_ratios(blocks: dict[str, list[tuple[int, float]]]) -> list[float]:
    """Each round's shards / in-memory images/s: the spread of ``input_ratio``."""
    return [_rate([shards]) / _rate([memory]) for shards, memory in zip(blocks["shards"], blocks["in_memory"])]


def _ordered(sources: dict[str, Any], attempt: int) -> list[tuple[str, Any]]:
    """The sides in this round's order: in-memory first in even rounds, shards first in odd ones (both take the
    same samples, and on a GPU the first step at a new sample size also pays for its kernel plans)."""
    sides = list(sources.items())
    return sides if attempt % 2 == 0 else sides[::-1]


def _private_step(base: Any, config: Any, dataset_size: int, batch: int) -> Any:
    from vip_core.config import PrivacyConfig
    from vip_core.privacy.plan import plan_privacy
    from vip_core.train.schedule import Schedule
    from vip_core.train.step import PrivateStep

    budget = PrivacyConfig(noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=1.0, target_epsilon=1e9, delta=1e-5,
                           accountant="rdp")
    plan = plan_privacy(budget, dataset_size=dataset_size, batch_size=batch, steps=100_000, fingerprint="bench")
    return PrivateStep(copy.deepcopy(base), plan, Schedule(peak_lr=LR, total_steps=100_000, kind="constant"),
                       physical_batch_size=config.private.physical_batch_size)


def _mae_loss(precision: str) -> Any:
    """The pre-training worker's loss; made once per run, as a worker does, so that the engine checks it once."""
    from vip_core.train.pipeline import mae_loss

    def loss(model: Any, inputs: tuple[Any, Any]) -> Any:
        return mae_loss(model, *inputs, precision)  # [b]

    return loss


def _block(step: Any, pixels: Any, loss: Any, count: int) -> int:
    """Takes ``count`` steps with images from ``pixels(local)``; returns the images they used."""

    def batch(local: Any, stream: Any) -> tuple[Any, Any]:
        return pixels(local), stream.uniform((len(local), step.model.num_patches))  # [k, 3, S, S], [k, L]

    return sum(step(batch, loss).examples for _ in range(count))
