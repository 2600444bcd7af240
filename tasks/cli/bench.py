"""``vip bench dp-step | render | ingest | train | eval``: benchmarks that print their figures beside a baseline measured in
the same run (the measurements are in ``tasks/benchmarks/``)."""

from __future__ import annotations

import argparse
from typing import Any

from tasks.cli.options import add_command, add_json, count, number, preset_name
from vip_core.train.precision import PRECISIONS


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks with a same-run baseline")
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, parser_class=type(parser))
    _register_dp_step(benchmarks)
    _register_render(benchmarks)
    _register_ingest(benchmarks)
    _register_train(benchmarks)
    _register_eval(benchmarks)
    _register_gpu_check(benchmarks)


def _register_dp_step(benchmarks: Any) -> None:
    parser = add_command(benchmarks, "dp-step", handle_dp_step, help="time and peak memory of a DP-AdamW step "
                         "of the MAE against the non-private step and opacus")
    add_json(parser)
    add_model_preset(parser)
    parser.add_argument("--img-size", type=count(1), default=32, help="image side in pixels (default: 32)")
    parser.add_argument("--batch", type=count(1), default=64, help="samples per physical batch (default: 64)")
    parser.add_argument("--microbatches", type=count(1), default=1,
                        help="physical batches per logical step, accumulated before the noise and the optimiser "
                        "step (default: 1); above 1 needs --no-opacus")
    parser.add_argument("--repeats", type=count(1), default=7, help="timed rounds of every mode (default: 7)")
    parser.add_argument("--warmup", type=count(0), default=2, help="untimed rounds first (default: 2)")
    parser.add_argument("--threads", type=count(0), default=1,
                        help="torch CPU threads (default: 1, steady on a shared machine); 0 keeps torch's default")
    parser.add_argument("--no-opacus", action="store_true", help="skip the two opacus modes")
    parser.add_argument("--no-secure", action="store_true", help="skip the secure-mode private step")
    parser.add_argument("--strict-float32", action="store_true",
                        help="also time the private step with privacy.strict_float32 (IEEE float32 norms and sums)")
    parser.add_argument("--width", type=count(1), default=None,
                        help="every encoder and decoder width set to this, one attention head (the preset's depths "
                        "and tokens kept): so little compute that a step's time is its host's, Python and dispatch, "
                        "as in a GPU step at a small batch")
    add_precision(parser)
    add_device(parser)
    parser.add_argument("--seed", type=int, default=0)


def _register_gpu_check(benchmarks: Any) -> None:
    parser = add_command(
        benchmarks, "gpu-check", handle_gpu_check,
        help="on a GPU machine: the gpu tests, then the DP step against the non-private one and opacus, one table",
        description="Runs `pytest -m gpu` on the privacy and benchmark tests, then `vip bench dp-step` of the preset's "
        "MAE under bf16 at each batch size (the strict IEEE float32 mode, and opacus's ghost clipping at "
        "--opacus-batches, in the same runs), and prints one table against the targets: DP <= x1.3 the "
        "non-private step, memory <= x1.2, ahead of opacus ghost. About 8 minutes of an H100 or H200.",
    )
    add_json(parser)
    add_model_preset(parser, default="vip-base")
    parser.add_argument("--img-size", type=count(1), default=224, help="image side in pixels (default: 224)")
    parser.add_argument("--batches", type=count(1), nargs="+", default=[256, 512],
                        help="physical batch sizes, one row each (default: 256 512)")
    parser.add_argument("--opacus-batches", type=count(1), nargs="*", default=[256, 512],
                        help="the batch sizes at which opacus's ghost clipping runs too (default: 256 512)")
    parser.add_argument("--repeats", type=count(1), default=5, help="timed rounds of every mode (default: 5)")
    parser.add_argument("--warmup", type=count(0), default=2, help="untimed rounds first (default: 2)")
    parser.add_argument("--no-tests", action="store_true", help="skip `pytest -m gpu`")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                        help="where the steps run (default: cuda; cpu for a small dry run of the table)")


def add_model_preset(parser: argparse.ArgumentParser, default: str = "tiny") -> None:
    """The preset whose model a benchmark measures (by name: the benchmark's targets are the preset's)."""
    parser.add_argument("--preset", default=default, type=preset_name,
                        help=f"the preset whose model is measured (default: {default})")


def add_precision(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="forward under bf16 autocast or not (default: fp32)")


def add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the models and the steps run (default: cpu)")


def _register_render(benchmarks: Any) -> None:
    parser = add_command(benchmarks, "render", handle_render, help="images/s of the render stage (encode and write "
                         "included) against the bare render loop")
    add_json(parser)
    parser.add_argument("--sizes", type=count(1), nargs="+", default=[64, 256], help="image sides (default: 64 256)")
    parser.add_argument("--num-images", type=count(1), default=96, help="images per pass (default: 96)")
    parser.add_argument("--images-per-program", type=count(1), default=16,
                        help="images per program draw (default: 16)")
    parser.add_argument("--repeats", type=count(1), default=2, help="passes of each side; the best counts (default: 2)")
    parser.add_argument("--seed", type=int, default=0)


def _register_ingest(benchmarks: Any) -> None:
    parser = add_command(benchmarks, "ingest", handle_ingest, help="images/s of the ingestion stage (filters, dedup, "
                         "decontamination) against img2dataset alone")
    add_json(parser)
    parser.add_argument("--num-images", type=count(1), default=1000, help="rows in the url list (default: 1000)")
    parser.add_argument("--max-side", type=count(1), default=256,
                        help="longer side of the served photographs (default: 256)")
    parser.add_argument("--image-size", type=count(1), default=64, help="output image side (default: 64)")
    parser.add_argument("--processes", type=count(1), default=1, help="download processes (default: 1)")
    parser.add_argument("--threads", type=count(1), default=16, help="threads per process (default: 16)")
    parser.add_argument("--samples-per-shard", type=count(1), default=250, help="rows per shard (default: 250)")
    parser.add_argument("--eval-images", type=count(0), default=200,
                        help="evaluation images to decontaminate against")
    parser.add_argument("--repeats", type=count(1), default=1, help="passes of each side; the best counts (default: 1)")
    parser.add_argument("--dedup-hashes", type=count(1), nargs=2, default=[1_000_000, 4_000_000], metavar=("SMALL", "LARGE"),
                        help="synthetic candidates the deduplication alone is timed on (default: 1000000 4000000)")
    parser.add_argument("--dedup-rows-per-partition", type=count(1), default=1_000_000,
                        help="the deduplication's partition size, data.ingest.rows_per_partition (default: 1000000)")
    parser.add_argument("--dedup-duplicate-share", type=number("in [0, 1)", lambda value: 0 <= value < 1), default=0.1,
                        help="share of the synthetic candidates that copy another (default: 0.1)")


def _register_train(benchmarks: Any) -> None:
    parser = add_command(benchmarks, "train", handle_train, help="images/s of a DP pre-training step reading shards "
                         "through the input pipeline against the same step on images in memory, and of the loader")
    add_json(parser)
    add_model_preset(parser)
    parser.add_argument("--img-size", type=count(1), help="image side in pixels (default: the preset's)")
    parser.add_argument("--batch", type=count(1), default=32, help="expected samples per step (default: 32)")
    parser.add_argument("--images", type=count(1), default=256, help="JPEG images in the shards (default: 256)")
    parser.add_argument("--source-side", type=count(1), default=256,
                        help="side of the stored JPEGs in pixels (default: 256)")
    parser.add_argument("--steps", type=count(1), default=6, help="timed steps per block (default: 6)")
    parser.add_argument("--rounds", type=count(1), default=8,
                        help="blocks of each side; the side going first alternates too (default: 8)")
    parser.add_argument("--warmup", type=count(0), default=2, help="untimed steps of each side first (default: 2)")
    parser.add_argument("--threads", type=count(0), default=1,
                        help="torch CPU threads (default: 1); 0 keeps torch's default")
    parser.add_argument("--decode-workers", type=count(1),
                        help="input pipeline decoders (default: the pre-training worker's, one per CPU, at least 2)")
    parser.add_argument("--decode-mode", choices=("processes", "threads"),
                        help="decode in processes or threads (default: the pre-training worker's)")
    parser.add_argument("--ahead", type=count(1), default=2, help="steps drawn and decoded ahead (default: 2)")
    add_precision(parser)
    add_device(parser)


def _register_eval(benchmarks: Any) -> None:
    parser = add_command(benchmarks, "eval", handle_eval, help="peak memory of the linear probe at two data set sizes, "
                         "and images/s of its input pipeline against the encoder alone")
    add_json(parser)
    add_model_preset(parser, default="vip-nano")
    parser.add_argument("--img-size", type=count(1), default=64, help="image side in pixels (default: 64)")
    parser.add_argument("--sizes", type=count(1), nargs=2, default=[5000, 20000], metavar=("SMALL", "LARGE"),
                        help="training images of the two runs (default: 5000 20000)")
    parser.add_argument("--val-images", type=count(1), default=500, help="held-out images (default: 500)")
    parser.add_argument("--classes", type=count(2), default=10, help="class folders (default: 10)")
    parser.add_argument("--source-side", type=count(1), default=128,
                        help="longer side of the stored JPEGs in pixels (default: 128)")
    parser.add_argument("--batch", type=count(2), default=256, help="images per batch (default: 256)")
    parser.add_argument("--loader-workers", type=count(0), default=1,
                        help="image-decoding processes (default: 1)")
    parser.add_argument("--epochs", type=count(1), default=2, help="epochs of the probe's head (default: 2)")
    parser.add_argument("--threads", type=count(0), default=1,
                        help="torch CPU threads (default: 1, steady on a shared machine, the other cores decoding); "
                        "0 keeps torch's default")
    add_precision(parser)
    add_device(parser)


def handle_eval(args: argparse.Namespace) -> int:
    from tasks.benchmarks.eval import bench_eval, meets_targets

    result = bench_eval(preset=args.preset, img_size=args.img_size, sizes=tuple(args.sizes),
                        val_images=args.val_images, classes=args.classes, source_side=args.source_side,
                        batch=args.batch, loader_workers=args.loader_workers, epochs=args.epochs, threads=args.threads,
                        precision=args.precision, device=args.device)
    met = meets_targets(result)
    lines = [f"peak RSS {result['peak_rss_mb_small']:8.1f} MB at {result['images_small']} images, "
             f"{result['peak_rss_mb_large']:8.1f} MB at {result['images_large']}: growth {result['rss_growth_mb']} MB "
             f"(target < {result['target_rss_growth_mb']:g}: {met['rss_growth']})",
             f"extraction {result['extract_images_per_s']:8.1f} img/s   its encoder forwards "
             f"{result['encoder_images_per_s']:8.1f} img/s   input_ratio {result['input_ratio']:.3f} "
             f"(target >= {result['target_input_ratio']}: {met['input_ratio']})",
             f"encoder alone, no decoding beside it {result['encoder_alone_images_per_s']:8.1f} img/s "
             f"(extraction / that {result['input_ratio_to_encoder_alone']:.3f})",
             f"probe head {result['probe_images_per_s']:8.1f} img/s; {result['loader_workers']} decoding processes; "
             f"load average {result['load_average']}"]
    return _report(args, result, lines)


def handle_train(args: argparse.Namespace) -> int:
    from tasks.benchmarks.train import bench_train

    result = bench_train(preset=args.preset, img_size=args.img_size, batch=args.batch, images=args.images,
                         source_side=args.source_side, steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                         threads=args.threads, decode_workers=args.decode_workers, decode_mode=args.decode_mode,
                         ahead=args.ahead, precision=args.precision, device=args.device)
    lines = [f"DP step from shards {result['step_images_per_s']:8.1f} img/s   from memory "
             f"{result['in_memory_images_per_s']:8.1f} img/s   input_ratio {result['input_ratio']:.3f} "
             f"(rounds {result['input_ratio_min']:.3f} to {result['input_ratio_max']:.3f}; "
             f"target >= {result['target_input_ratio']}: {result['meets_target']})",
             f"loader alone {result['loader_images_per_s_per_proc']:8.1f} img/s per process; "
             f"{result['decode_workers']} decoding {result['decode_mode']}; "
             f"load average {result['load_average']}"]
    return _report(args, result, lines)


def handle_dp_step(args: argparse.Namespace) -> int:
    from tasks.benchmarks.dp_step import bench_dp_step

    result = bench_dp_step(preset=args.preset, img_size=args.img_size, batch=args.batch, repeats=args.repeats,
                           warmup=args.warmup, threads=args.threads, opacus=not args.no_opacus, seed=args.seed,
                           precision=args.precision, microbatches=args.microbatches, device=args.device,
                           secure=not args.no_secure, strict=args.strict_float32, width=args.width)
    return _report(args, result, [f"{key:>28}: {value}" for key, value in result.items()])


def handle_gpu_check(args: argparse.Namespace) -> int:
    from tasks.benchmarks.gpu_check import gpu_check, table

    check = gpu_check(device=args.device, preset=args.preset, img_size=args.img_size, batches=tuple(args.batches),
                      opacus_batches=tuple(args.opacus_batches), repeats=args.repeats, warmup=args.warmup,
                      tests=not args.no_tests)
    return _report(args, check, table(check))


def handle_render(args: argparse.Namespace) -> int:
    from tasks.benchmarks.render import bench_render

    result = bench_render(args.sizes, args.num_images, args.images_per_program, args.repeats, args.seed)
    lines = [f"{size:>4} px  bare {row['bare_images_per_s']:8.1f} img/s  stage {row['stage_images_per_s']:8.1f} "
             f"img/s  stage/bare {row['stage_over_bare']:.2f}" for size, row in result["sizes"].items()]
    lines.append(f"device: {result['device']}; target stage/bare >= {result['target_stage_over_bare']}: "
                 f"{result['meets_target']}")
    return _report(args, result, lines)


def handle_ingest(args: argparse.Namespace) -> int:
    from tasks.benchmarks.ingest import bench_ingest

    result = bench_ingest(num_images=args.num_images, max_side=args.max_side, image_size=args.image_size,
                          processes=args.processes, threads=args.threads, samples_per_shard=args.samples_per_shard,
                          eval_images=args.eval_images, repeats=args.repeats, dedup_hashes=tuple(args.dedup_hashes),
                          rows_per_partition=args.dedup_rows_per_partition,
                          duplicate_share=args.dedup_duplicate_share)
    lines = [f"img2dataset alone {result['img2dataset_images_per_s']:8.1f} img/s   ingest stage "
             f"{result['stage_images_per_s']:8.1f} img/s   overhead {100 * result['overhead']:.1f}%",
             f"target overhead < {100 * result['target_overhead']:.0f}%: {result['meets_target']}",
             f"cleaning {result['clean_images_per_cpu_s']:8.1f} images per CPU-second of the stage's own process"]
    lines += [f"deduplication of {result[f'dedup_hashes_{size}']:>10,} hashes {result[f'dedup_s_{size}']:8.2f} s   "
              f"largest worker {result[f'dedup_peak_mb_{size}']:7.1f} MB ({result[f'dedup_partitions_{size}']} partitions)"
              for size in ("small", "large")]
    lines.append(f"x{result['dedup_size_ratio']} the hashes: x{result['dedup_time_ratio']} the time (target < "
                 f"{result['target_dedup_time_ratio']}), x{result['dedup_memory_ratio']} the memory (target < "
                 f"{result['target_dedup_memory_ratio']}): {result['dedup_meets_target']}")
    return _report(args, result, lines)


def _report(args: argparse.Namespace, result: dict, lines: list[str]) -> int:
    from tasks.cli import print_json, report

    if args.json:
        print_json(result)
    else:
        report("\n".join(lines))
    return 0
