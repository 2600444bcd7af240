"""``vip bench render``: images/s of the render stage against the bare render loop, in the same run.

The bare loop compiles and draws the plan's programs and reads the pixels back (``render_images``); the
stage (``run_render``) does the same and also encodes JPEGs, writes the shard, its records, the manifest
and the stats. Both run the same plan in this process, one GL context each, alternately, and each rate
is the best of ``--repeats`` passes. Mesa's on-disk shader cache is turned off for the benchmark so that
neither side gets the other's compiled programs.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

TARGET_RATIO = 0.7


def bench_render(sizes: list[int], num_images: int, images_per_program: int, repeats: int, seed: int) -> dict:
    """Best-of-``repeats`` images/s of the bare loop and of the stage at each size, and their ratio."""
    from vip_core.config import get_preset, with_overrides

    os.environ["MESA_SHADER_CACHE_DISABLE"] = "true"  # neither side gets the other's compiled programs
    rows: dict[str, dict[str, float]] = {}
    device = ""
    for size in sizes:
        settings = {
            "num_images": num_images, "size": size, "seed": seed, "images_per_program": images_per_program,
            "samples_per_shard": num_images, "workers": 1,
        }
        config = with_overrides(get_preset("tiny"), {f"data.render.{k}": v for k, v in settings.items()})
        bare, stage = [], []
        for _ in range(repeats):
            rate, device = _bare_rate(config)
            bare.append(rate)
            stage.append(_stage_rate(config))
        rows[str(size)] = {
            "bare_images_per_s": round(max(bare), 2),
            "stage_images_per_s": round(max(stage), 2),
            "stage_over_bare": round(max(stage) / max(bare), 3),
        }
    return {
        "benchmark": "render", "device": device, "programs": "generator", "num_images": num_images,
        "images_per_program": images_per_program, "repeats": repeats, "sizes": rows,
        "target_stage_over_bare": TARGET_RATIO,
        "meets_target": all(row["stage_over_bare"] >= TARGET_RATIO for row in rows.values()),
    }


def _bare_rate(config: Any) -> tuple[float, str]:
    """Images/s of context set-up, compile, draw and read-back alone; and the GL renderer's name."""
    from vip_core.synthetic.plan import GeneratedPrograms, ProgramCache, RenderPlan, render_images
    from vip_core.synthetic.renderer import ShaderRenderer

    settings = config.data.render
    plan = RenderPlan(settings.seed, settings.num_images, settings.images_per_program, settings.num_programs)
    started = time.perf_counter()
    with ShaderRenderer(settings.size) as renderer:
        cache = ProgramCache(renderer)
        outcome = render_images(cache, plan, GeneratedPrograms(settings.num_programs), range(settings.num_images))
        cache.release()
        device = renderer.device
    return len(outcome.images) / (time.perf_counter() - started), device


def _stage_rate(config: Any) -> float:
    """Images/s of the whole render stage into a fresh folder."""
    from tasks.stages.render import run_render

    with tempfile.TemporaryDirectory(prefix="vip-bench-render-") as folder:
        started = time.perf_counter()
        result = run_render(config, folder)
        return result["images"] / (time.perf_counter() - started)
