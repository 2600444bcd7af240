"""``vip bench eval``: the linear probe's peak memory at two data set sizes, and its input pipeline against the
encoder alone.

An ImageFolder of ``max(sizes)`` training JPEG photographs of ``--source-side`` px (the sample photographs, in
``--classes`` class folders) and ``--val-images`` held-out ones is written to a temporary folder; a data set of each
size is the first images of each class of it (hard links). For each size, a fresh process runs the linear probe
the way the ``linprobe`` job does (:mod:`vip_core.eval.jobs`): the frozen encoder (``--preset`` at ``--img-size``,
every block's pooled features: the paper's protocol) over the training images through the input pipeline
(``--loader-workers`` decoding processes, JPEG draft decoding), the features written to disk in bf16
(:mod:`vip_core.eval.feature_store`), then ``--epochs`` epochs of the probe's head reading them back a batch at a
time. Its peak resident memory (``ru_maxrss`` of that process) is ``peak_rss_mb_<small|large>``: it stays flat
when nothing the probe holds grows with the images (target: large − small < 100 MB for 4x the images).

``extract_images_per_s`` is the encoder with the input pipeline (the larger size's extraction: decoding, the
forward, the write); ``encoder_images_per_s`` the same encoder's forwards in that extraction, each timed on its batch
once the batch is in memory (on its device, to the end of its kernels): the same-run baseline, measured in the same
seconds as the extraction, so that the load of a shared machine falls on both alike; ``input_ratio`` their ratio,
the share of the extraction's time the encoder computes (target ≥ 0.9: it is not kept waiting for images).
``encoder_alone_images_per_s`` is the encoder on batches made in memory beforehand, in the same process just
before and after the extraction (the mean of the two), with no decoding beside it: on a CPU, the decoding
processes take cores from the encoder, which this rate leaves out and ``encoder_images_per_s`` includes. The
photographs are ``UNIQUE_PHOTOS`` distinct JPEGs, repeated under other names (the encoder's speed does not depend on
what it sees).
``probe_images_per_s`` is the head's training over the stored features (the larger size). On a shared machine the
figures are noisy: the load average is printed with them.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

TARGET_RSS_GROWTH_MB = 100.0
TARGET_INPUT_RATIO = 0.9
ENCODER_BATCHES = 10
UNIQUE_PHOTOS = 2000


def bench_eval(*, preset: str, img_size: int | None, sizes: tuple[int, int], val_images: int, classes: int,
               source_side: int, batch: int, loader_workers: int, epochs: int, threads: int, precision: str,
               device: str) -> dict[str, Any]:
    """Peak memory of the probe at both sizes, and the images/s of extraction, the encoder alone and the probe."""
    from tasks.benchmarks.device import bench_device
    from vip_core.config import get_preset, with_overrides

    bench_device(device)
    small, large = sorted(sizes)
    if small < classes:
        raise ValueError(f"--sizes: {small} images cannot fill {classes} classes")
    config = get_preset(preset)
    if img_size is not None:
        config = with_overrides(config, {"model.img_size": img_size})
    run = dict(model=config.model.model_dump(mode="json"), batch=batch, loader_workers=loader_workers, epochs=epochs,
               threads=threads, precision=precision, device=device)
    with tempfile.TemporaryDirectory(prefix="vip-bench-eval-") as folder:
        full = _write_photos(Path(folder) / "full", large, val_images, classes, source_side)
        runs = {name: _in_fresh_process(_probe_run, str(_first_images(full, Path(folder) / name, count, classes)), run)
                for name, count in (("small", small), ("large", large))}
    large_run = runs["large"]
    return {
        "benchmark": "eval", "preset": preset, "device": device, "img_size": config.model.img_size,
        "features": large_run["features"], "batch": batch, "loader_workers": loader_workers, "precision": precision,
        "torch_threads": large_run["threads"], "epochs": epochs,
        "images_small": small, "images_large": large,
        "peak_rss_mb_small": runs["small"]["peak_rss_mb"], "peak_rss_mb_large": large_run["peak_rss_mb"],
        "rss_growth_mb": round(large_run["peak_rss_mb"] - runs["small"]["peak_rss_mb"], 1),
        "target_rss_growth_mb": TARGET_RSS_GROWTH_MB,
        "extract_images_per_s": large_run["extract_images_per_s"],
        "encoder_images_per_s": large_run["encoder_images_per_s"],
        "input_ratio": round(large_run["extract_images_per_s"] / large_run["encoder_images_per_s"], 4),
        "target_input_ratio": TARGET_INPUT_RATIO,
        "encoder_alone_images_per_s": large_run["encoder_alone_images_per_s"],
        "input_ratio_to_encoder_alone": round(large_run["extract_images_per_s"]
                                              / large_run["encoder_alone_images_per_s"], 4),
        "probe_images_per_s": large_run["probe_images_per_s"],
        "extract_images_per_s_small": runs["small"]["extract_images_per_s"],
        "stored_feature_mb_large": large_run["stored_feature_mb"],
        "load_average": round(os.getloadavg()[0], 2),
    }


def meets_targets(result: dict[str, Any]) -> dict[str, bool]:
    """Whether each target is met."""
    return {"rss_growth": result["rss_growth_mb"] < TARGET_RSS_GROWTH_MB,
            "input_ratio": result["input_ratio"] >= TARGET_INPUT_RATIO}


def _write_photos(root: Path, train: int, val: int, classes: int, side: int) -> Path:
    """``train`` and ``val`` JPEG photographs dealt round-robin into ``classes`` class folders of ``root``; the
    ``UNIQUE_PHOTOS`` first written, the others hard links to them."""
    from tasks.fixtures.web import photo_bytes

    written: list[Path] = []
    for split, count, offset in (("train", train, 0), ("val", val, train)):
        for index in range(count):
            path = root / split / f"n{index % classes:08d}" / f"{offset + index:07d}.JPEG"
            path.parent.mkdir(parents=True, exist_ok=True)
            if len(written) < UNIQUE_PHOTOS:
                path.write_bytes(photo_bytes(offset + index, side))
                written.append(path)
            else:
                os.link(written[(offset + index) % UNIQUE_PHOTOS], path)
    return root


def _first_images(full: Path, root: Path, count: int, classes: int) -> Path:
    """A data set of ``count`` training images of ``full`` (the same held-out split), as hard links."""
    per_class = count // classes
    for split in ("train", "val"):
        for class_dir in sorted((full / split).iterdir()):
            target = root / split / class_dir.name
            target.mkdir(parents=True)
            files = sorted(class_dir.iterdir())
            for path in files[:per_class] if split == "train" else files:
                os.link(path, target / path.name)
    return root


def _in_fresh_process(function: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``function(*args)`` in a new spawned process, so that its peak memory is its own."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def _setup(run: dict[str, Any]) -> tuple[Any, Any]:
    """The process's torch threads, and the encoder on the device (random init: its speed is its shape's)."""
    import torch

    from vip_core.config import ModelConfig
    from vip_core.models import build_encoder

    if run["threads"]:
        torch.set_num_threads(run["threads"])
    torch.manual_seed(0)
    device = torch.device(run["device"])
    return build_encoder(ModelConfig.model_validate(run["model"])).eval().to(device), device


def _probe_run(root: str, run: dict[str, Any]) -> dict[str, Any]:
    """The linear probe on ``root`` in this process: extraction to disk (between two timings of the encoder alone),
    the head's epochs; its peak memory."""
    import torch

    from tasks.benchmarks.device import finish
    from vip_core.eval.datasets import open_classification
    from vip_core.eval.feature_store import write_features
    from vip_core.eval.linprobe import ProbeSettings, evaluate_probe, train_probe
    from vip_core.eval.loading import Loading

    encoder, device = _setup(run)
    data = open_classification(root)
    img_size, depth = run["model"]["img_size"], run["model"]["depth"]
    loading = Loading(device, run["loader_workers"])
    options = dict(last_blocks=depth, batch_size=run["batch"], loading=loading, precision=run["precision"])
    with tempfile.TemporaryDirectory(prefix="vip-bench-features-") as folder:
        before = _encoder_rate(encoder, device, run)
        timed = TimedEncoder(encoder, device)
        started = time.perf_counter()
        train = write_features(timed, data.split("train", img_size), folder, "train", **options)
        finish(device)
        extract_s = time.perf_counter() - started
        after = _encoder_rate(encoder, device, run)
        val = write_features(encoder, data.split("val", img_size), folder, "val", **options)
        settings = ProbeSettings(epochs=run["epochs"], lr=0.1, batch_size=run["batch"], optimizer="sgd")
        started = time.perf_counter()
        head = train_probe(train, data.num_classes, settings, device)
        finish(device)
        probe_s = time.perf_counter() - started
        evaluate_probe(head, val, run["batch"], device)
        stored_mb = sum(path.stat().st_size for path in Path(folder).glob("train-*.bin")) / 1024**2
        train.close()
        val.close()
    return {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "extract_images_per_s": round(len(train) / extract_s, 1),
            "encoder_images_per_s": round(len(train) / timed.seconds, 1),
            "encoder_alone_images_per_s": round((before + after) / 2, 1),
            "probe_images_per_s": round(run["epochs"] * len(train) / probe_s, 1),
            "features": train.dim, "stored_feature_mb": round(stored_mb, 1), "threads": torch.get_num_threads()}


class TimedEncoder:
    """The encoder as the extraction sees it, each forward timed to the end of its kernels (``seconds``)."""

    def __init__(self, encoder: Any, device: Any) -> None:
        self.encoder, self.device, self.seconds = encoder, device, 0.0

    @property
    def blocks(self) -> Any:
        return self.encoder.blocks

    def eval(self) -> "TimedEncoder":
        self.encoder.eval()
        return self

    def to(self, device: Any) -> "TimedEncoder":
        self.encoder.to(device)
        return self

    def forward_intermediates(self, images: Any, **options: Any) -> Any:
        from tasks.benchmarks.device import finish

        finish(self.device)  # the batch is on the device: what comes now is the encoder's
        started = time.perf_counter()
        blocks = self.encoder.forward_intermediates(images, **options)
        finish(self.device)
        self.seconds += time.perf_counter() - started
        return blocks


def _encoder_rate(encoder: Any, device: Any, run: dict[str, Any]) -> float:
    """Images/s of the encoder alone on ``ENCODER_BATCHES`` batches made on the device beforehand, under the run's
    precision, the features brought back to the CPU as the extraction does."""
    import torch

    from tasks.benchmarks.device import finish
    from vip_core.eval.features import pooled_block_features
    from vip_core.train.precision import autocast

    size, depth = run["model"]["img_size"], run["model"]["depth"]
    batches = [torch.randn(run["batch"], 3, size, size, device=device) for _ in range(ENCODER_BATCHES)]  # [B, 3, S, S]
    with torch.no_grad(), autocast(run["precision"], device):
        pooled_block_features(encoder, batches[0], depth)  # warm-up
        finish(device)
        started = time.perf_counter()
        for images in batches:
            pooled_block_features(encoder, images, depth).float().cpu()
        finish(device)
    return ENCODER_BATCHES * run["batch"] / (time.perf_counter() - started)
