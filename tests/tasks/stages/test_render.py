"""The render stage: shards, manifest, stats, determinism, resuming, program folders.

Real GL (moderngl through EGL), 32 px, a few dozen images."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tasks.stages.render import run_render
from vip_core.config import get_preset, with_overrides
from vip_core.data.shards import count_samples, iter_samples, list_shards, sample_image
from vip_core.synthetic.programs import generate_program
from vip_core.synthetic.renderer import ShaderRenderer


ROOT = Path(__file__).resolve().parents[3]

GOOD = "void mainImage(out vec4 c, in vec2 f) { c = vec4(f / iResolution.xy, 0.5 + 0.5 * sin(iTime), 1.0); }"

BLACK = "void mainImage(out vec4 c, in vec2 f) { c = vec4(0.0, 0.0, 0.0, 1.0); }"

BROKEN = "void mainImage(out vec4 c, in vec2 f) { c = not_declared; }"

MULTIPASS = "void mainImage(out vec4 c, in vec2 f) { c = texture(iChannel0, f / iResolution.xy); }"


def _config(**render):
    settings = {"num_images": 24, "size": 32, "images_per_program": 4, "samples_per_shard": 8, **render}
    return with_overrides(get_preset("tiny"), {f"data.render.{key}": value for key, value in settings.items()})


def _digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in list_shards(folder, "shard")}


def _manifest(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    output = tmp_path_factory.mktemp("render") / "synthetic"
    return output, run_render(_config(), output)


def test_render_writes_shards_manifest_and_stats(rendered):
    output, result = rendered
    assert result["images"] == 24 and result["shards"] == 3 and result["rendered_shards"] == 3
    assert count_samples(list_shards(output, "shard")) == 24
    samples = list(iter_samples(list_shards(output, "shard")))
    keys = [sample["__key__"] for sample in samples]
    assert sorted(keys) == [f"{i:09d}" for i in range(24)]
    for sample in samples:
        image = np.asarray(sample_image(sample))
        assert image.shape == (32, 32, 3) and image.reshape(-1, 3).std(axis=0).max() > 4.0
        assert sample["json"]["program"].startswith("gen-") and 0.1 <= sample["json"]["time"] <= 10.0
    manifest = _manifest(output)
    assert [record["key"] for record in manifest] == keys
    assert all(record["seed"] == 0 for record in manifest)
    assert len({record["program"] for record in manifest}) >= 6  # 4 images per program draw
    stats = json.loads((output / "stats.json").read_text())
    assert stats["images"] == 24 and stats["programs"] == "generator"


def test_render_is_deterministic_across_worker_counts_and_differs_by_seed(rendered, tmp_path):
    output, _ = rendered
    again = run_render(_config(workers=2), tmp_path / "two-workers")
    assert again["images"] == 24
    assert _digests(tmp_path / "two-workers") == _digests(output)
    run_render(_config(seed=1), tmp_path / "seed-1")
    assert set(_digests(tmp_path / "seed-1").values()).isdisjoint(_digests(output).values())


def test_a_killed_render_resumes_without_redoing_or_duplicating(rendered, tmp_path):
    reference, _ = rendered
    output = tmp_path / "killed"
    script = (
        "from tasks.stages.render import run_render; from tests.tasks.stages.test_render import _config; "
        f"run_render(_config(), {str(output)!r})"
    )
    # Shader compiles without Mesa's disk cache take a good fraction of a second: the kill lands mid-run.
    environment = {**os.environ, "MESA_SHADER_CACHE_DISABLE": "true"}
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=environment)
    deadline = time.monotonic() + 120
    while not (output / "shard-000000.tar").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    finished_before = set(_digests(output))
    assert "shard-000000.tar" in finished_before and len(finished_before) < 3
    mtimes = {name: os.stat(output / name).st_mtime_ns for name in finished_before}

    result = run_render(_config(), output)
    assert result["resumed_shards"] == len(finished_before)
    assert result["rendered_shards"] == 3 - len(finished_before)
    assert {name: os.stat(output / name).st_mtime_ns for name in finished_before} == mtimes  # not redone
    assert _digests(output) == _digests(reference)
    keys = [record["key"] for record in _manifest(output)]
    assert len(keys) == len(set(keys)) == 24
    assert not list(output.rglob("*.partial"))


def test_a_worker_that_dies_is_reported_and_a_rerun_completes(tmp_path, monkeypatch):
    monkeypatch.setenv("MESA_SHADER_CACHE_DISABLE", "true")  # spawned workers compile slowly: killed mid-run
    output, errors = tmp_path / "crashed", []

    def render() -> None:
        try:
            run_render(_config(num_images=16, workers=2, samples_per_shard=4, images_per_program=1), output)
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=render)
    thread.start()
    deadline, workers = time.monotonic() + 60, []
    while len(workers) < 2 and time.monotonic() < deadline:
        workers = [child for child in psutil.Process().children() if "spawn_main" in " ".join(child.cmdline())]
        time.sleep(0.05)
    while not list(output.glob("shard-*.tar")) and time.monotonic() < deadline:
        time.sleep(0.005)
    workers[0].kill()
    thread.join(timeout=120)
    assert errors and "a render worker died" in errors[0] and "run again to resume" in errors[0]

    monkeypatch.delenv("MESA_SHADER_CACHE_DISABLE")
    result = run_render(_config(num_images=16, workers=1, samples_per_shard=4, images_per_program=1), output)
    assert result["images"] == 16 and result["resumed_shards"] >= 1 and result["rendered_shards"] >= 1
    keys = [record["key"] for record in _manifest(output)]
    assert len(keys) == len(set(keys)) == 16


def test_other_settings_in_the_same_folder_are_refused(rendered):
    output, _ = rendered
    before = _digests(output)
    with pytest.raises(ValueError, match="size=32, not 48"):
        run_render(_config(size=48), output)
    assert _digests(output) == before


def test_program_folder_skips_what_cannot_render_and_counts_why(tmp_path):
    shaders = tmp_path / "shaders"
    (shaders / "nested").mkdir(parents=True)
    (shaders / "good.frag").write_text(GOOD)
    (shaders / "black.frag").write_text(BLACK)
    (shaders / "nested" / "broken.glsl").write_text(BROKEN)
    (shaders / "buffer.frag").write_text(MULTIPASS)
    two_passes = {"renderpass": [{"type": "buffer", "code": GOOD}, {"type": "image", "code": GOOD}]}
    (shaders / "two-passes.fragment").write_text(json.dumps(two_passes))
    (shaders / "one-pass.fragment").write_text(json.dumps({"renderpass": [{"type": "image", "code": GOOD}]}))
    (shaders / "README.txt").write_text("not a program")
    result = run_render(_config(num_images=12, images_per_program=1), tmp_path / "out", shaders=shaders)
    assert result["images"] == 12
    assert result["excluded_programs"] == {"multipass": 2}
    assert result["skipped"]["compile_error"] >= 1 and result["skipped"]["constant"] >= 1
    assert {record["program"] for record in _manifest(tmp_path / "out")} == {"good.frag", "one-pass.fragment"}


def _rerender(renderer: ShaderRenderer, program_id: str, time_s: float) -> np.ndarray:
    return renderer.render_source(generate_program(int(program_id.removeprefix("gen-"))).source, time_s).astype(float)


def test_the_manifest_says_how_each_image_was_made(rendered):
    output, _ = rendered
    samples = list(iter_samples(list_shards(output, "shard")))[:3]
    with ShaderRenderer(32) as renderer:
        for sample in samples:
            again = _rerender(renderer, sample["json"]["program"], sample["json"]["time"])
            assert np.abs(np.asarray(sample_image(sample), dtype=float) - again).mean() < 4.0  # JPEG q95 4:4:4


def test_mixup_images_are_the_recorded_convex_mix(tmp_path):
    result = run_render(_config(num_images=8, mixup=3, samples_per_shard=8), tmp_path / "mixed")
    assert result["images"] == 8
    for record in _manifest(tmp_path / "mixed"):
        weights = [component["weight"] for component in record["components"]]
        assert len(weights) == 3 and min(weights) >= 0 and sum(weights) == pytest.approx(1.0)
    sample = next(iter_samples(list_shards(tmp_path / "mixed", "shard")))
    with ShaderRenderer(32) as renderer:
        mixed = sum(c["weight"] * _rerender(renderer, c["program"], c["time"]) for c in sample["json"]["components"])
    assert np.abs(np.asarray(sample_image(sample), dtype=float) - mixed).mean() < 4.0


@pytest.mark.slow
def test_tiny_preset_render_on_two_workers_with_6_mixup(tmp_path):
    config = with_overrides(get_preset("tiny"), {"data.render.workers": 2, "data.render.mixup": 6,
                                                 "data.render.samples_per_shard": 64, "data.render.size": 64})
    result = run_render(config, tmp_path / "tiny")
    assert result["images"] == 256 and result["shards"] == 4
    records = _manifest(tmp_path / "tiny")
    assert len({record["key"] for record in records}) == 256
    assert all(len(record["components"]) == 6 for record in records)
    programs = {component["program"] for record in records for component in record["components"]}
    assert len(programs) >= 256 // 8 - 2
