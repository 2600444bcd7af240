"""The synthetic-image library: Shadertoy wrapping, the program generator, the GL renderer, mixup.

Every render here is real: moderngl through EGL (Mesa llvmpipe on this machine), 32 px.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from vip_core.synthetic.mixup import convex_mix, mixup_weights
from vip_core.synthetic.plan import ProgramCache, RenderPlan, render_images
from vip_core.synthetic.programs import GLSL_LIBRARY, ShaderProgram, generate_program
from vip_core.synthetic.renderer import ShaderCompileError, ShaderRenderer, is_near_constant
from vip_core.synthetic.shadertoy import MULTIPASS, NO_MAIN_IMAGE, UNREADABLE, check_program, read_program
from vip_core.synthetic.sheet import contact_sheet

SIZE = 32

UNIFORMS_PROGRAM = """
void mainImage(out vec4 fragColor, in vec2 fragCoord) {
    vec2 uv = fragCoord / iResolution.xy;
    float frame = float(iFrame) / 600.0;
    float date = (iDate.w - 43200.0) / 10.0 + iDate.x * 0.0 + iMouse.x;
    fragColor = vec4(uv.x, uv.y, fract(iTime / 10.0) * 0.5 + frame * 0.25 + date * 0.25, 1.0);
}
"""

BLACK_PROGRAM = "void mainImage(out vec4 c, in vec2 f) { c = vec4(0.0, 0.0, 0.0, 1.0); }"
STRIPES_PROGRAM = "void mainImage(out vec4 c, in vec2 f) { c = vec4(step(0.5, fract(f.x / 8.0 + iTime)), 0.2, 0.6, 1.0); }"


@pytest.fixture(scope="module")
def renderer():
    with ShaderRenderer(SIZE) as gl:
        yield gl


def test_renderer_runs_on_a_real_gl_context(renderer):
    assert renderer.ctx.version_code >= 430
    assert renderer.device


def test_shadertoy_uniforms_and_orientation(renderer):
    image = renderer.render_source(UNIFORMS_PROGRAM, time=4.0).astype(float)  # [S, S, 3]
    assert image.shape == (SIZE, SIZE, 3)
    # Shadertoy's fragCoord starts bottom-left; the image is stored top row first.
    assert image[0, :, 1].mean() > 240 and image[-1, :, 1].mean() < 15
    assert image[:, 0, 0].mean() < 15 and image[:, -1, 0].mean() > 240
    # iTime 4 -> 0.2, iFrame 240 -> 0.4, iDate.w 43204 -> 0.4: blue = 0.5 * 0.4 + 0.25 * 0.4 + 0.25 * 0.4.
    assert image[..., 2].mean() == pytest.approx(0.4 * 255, abs=2)


def test_exported_headers_are_stripped_and_line_numbers_kept(renderer):
    exported = "#version 300 es\nuniform float iTime;\nuniform vec3 iResolution;\n" + STRIPES_PROGRAM
    assert not is_near_constant(renderer.render_source(exported, time=0.0))
    with pytest.raises(ShaderCompileError, match=r"(?s)0:3\(\d+\): error: .undefined_name"):
        renderer.compile("void mainImage(out vec4 c, in vec2 f) {\n    c = vec4(1.0);\n    c = undefined_name;\n}")


def test_check_program_rejects_multipass_and_missing_main_image():
    assert check_program(STRIPES_PROGRAM) is None
    assert check_program("void mainImage(out vec4 c, in vec2 f) { c = texture(iChannel0, f); }") == MULTIPASS
    assert check_program("// reads iChannel0 in a comment only\n" + STRIPES_PROGRAM) is None
    assert check_program("void main() { gl_FragColor = vec4(1.0); }") == NO_MAIN_IMAGE


def _shadertoy_json(*passes: tuple[str, str]) -> str:
    """A program in Shadertoy's API JSON, the form of Shaders21k's ``.fragment`` files."""
    return json.dumps({"info": {"id": "abc"}, "renderpass": [{"type": kind, "code": code} for kind, code in passes]})


def test_read_program_takes_shadertoy_json_passes(renderer):
    common = "vec3 tint() { return vec3(0.2, 0.9, 0.4); }"
    image = "void mainImage(out vec4 c, in vec2 f) { c = vec4(tint() * step(16.0, f.x), 1.0); }"
    code, reason = read_program(_shadertoy_json(("common", common), ("image", image)))
    assert reason is None
    rendered = renderer.render_source(code, time=1.0)  # [S, S, 3]
    assert rendered[:, :16].max() == 0 and np.allclose(rendered[:, 16:], [51, 230, 102], atol=1)
    assert read_program(_shadertoy_json(("buffer", image), ("image", image))) == (None, MULTIPASS)
    assert read_program('{"renderpass": ') == (None, UNREADABLE)
    assert read_program(STRIPES_PROGRAM) == (STRIPES_PROGRAM, None)


def test_same_program_and_time_give_byte_identical_images(renderer):
    program = generate_program(7).source
    first = renderer.render_source(program, time=3.5)
    with ShaderRenderer(SIZE) as other:
        second = other.render_source(program, time=3.5)
    assert first.tobytes() == second.tobytes()
    assert renderer.render_source(program, time=6.0).tobytes() != first.tobytes()


def _skeleton(source: str) -> str:
    """The program with every number replaced: what is left is its structure."""
    return re.sub(r"\d+(\.\d+)?", "#", source)


def test_generator_makes_thousands_of_distinct_programs():
    sources = [generate_program(seed).source for seed in range(2000)]
    assert len(set(sources)) == 2000
    assert generate_program(123).source == sources[123]  # deterministic
    assert len({_skeleton(source) for source in sources}) > 1500  # distinct structures, not just constants
    bodies = [source.replace(GLSL_LIBRARY, "") for source in sources]  # what each program calls
    raymarched = sum("float map(vec3 p)" in body for body in bodies)
    assert 300 < raymarched < 1000
    for feature in ("fbm(", "voronoi(", "escape(", "kali(", "kaleido(", "smin(", "palette(", "hsv2rgb(", "sdTorus("):
        assert sum(feature in body for body in bodies) > 50, feature


def test_a_sample_of_generated_programs_compiles_and_renders_diverse_images(renderer):
    seeds = np.random.default_rng(0).choice(21_000, size=12, replace=False)
    images = []
    for seed in seeds:
        compiled = renderer.compile(generate_program(int(seed)).source)  # raises if it does not compile
        images.append(renderer.render(compiled, time=2.0).astype(float))
        compiled.release()
    assert sum(not is_near_constant(image) for image in images) >= 10
    # Pairwise: mean absolute pixel difference and colour-histogram distance between distinct programs.
    histograms = [np.histogramdd(im.reshape(-1, 3), bins=4, range=[(0, 256)] * 3)[0].ravel() / SIZE**2 for im in images]
    pixel_distances, histogram_distances = [], []
    for i in range(len(images)):
        for j in range(i + 1, len(images)):
            pixel_distances.append(np.abs(images[i] - images[j]).mean())
            histogram_distances.append(0.5 * np.abs(histograms[i] - histograms[j]).sum())
    assert min(pixel_distances) > 5 and np.median(pixel_distances) > 30
    assert np.median(histogram_distances) > 0.5


def test_render_images_skips_broken_and_constant_programs(renderer):
    pool = [
        ShaderProgram("broken", "void mainImage(out vec4 c, in vec2 f) { c = nope; }"),
        ShaderProgram("black", BLACK_PROGRAM),
        ShaderProgram("stripes", STRIPES_PROGRAM),
    ]
    plan = RenderPlan(seed=0, num_images=6, images_per_program=1, pool_size=len(pool))
    cache = ProgramCache(renderer)
    outcome = render_images(cache, plan, pool, range(6))
    cache.release()
    assert sorted(outcome.images) == list(range(6))
    assert {item.program_id for item in outcome.images.values()} == {"stripes"}
    assert outcome.skipped["compile_error"] >= 1 and outcome.skipped["constant"] >= 1
    assert all(0.1 <= item.time <= 10.0 for item in outcome.images.values())


def test_program_draws_use_the_whole_pool_before_repeating():
    plan = RenderPlan(seed=3, num_images=1000, images_per_program=10, pool_size=100)
    assert sorted(plan.program_index(slot, 0) for slot in range(100)) == list(range(100))
    other_seed = RenderPlan(seed=4, num_images=1000, images_per_program=10, pool_size=100)
    assert [plan.program_index(s, 0) for s in range(100)] != [other_seed.program_index(s, 0) for s in range(100)]


def test_a_flat_colour_is_near_constant_and_a_gradient_is_not():
    flat = np.zeros((16, 16, 3), dtype=np.uint8) + np.array([242, 4, 42], dtype=np.uint8)  # far-apart channels
    assert is_near_constant(flat)
    gradient = flat.copy()
    gradient[..., 1] = np.arange(16, dtype=np.uint8)[None, :] * 4
    assert not is_near_constant(gradient)


def test_convex_mixup():
    rng = np.random.default_rng(0)
    weights = mixup_weights(rng, 6)
    assert weights.shape == (6,) and np.all(weights >= 0) and weights.sum() == pytest.approx(1.0)
    images = [np.full((4, 4, 3), value, dtype=np.uint8) for value in (0, 100, 200)]
    mixed = convex_mix(images, np.array([0.5, 0.25, 0.25]))
    assert np.all(mixed == 75)
    with pytest.raises(ValueError, match="sum to 1"):
        convex_mix(images, np.array([0.5, 0.5, 0.5]))


def test_contact_sheet_tiles_images():
    tiles = [np.full((8, 8, 3), i * 20, dtype=np.uint8) for i in range(10)]
    sheet = contact_sheet(tiles, columns=4, gap=2)
    assert sheet.shape == (3 * 10 + 2, 4 * 10 + 2, 3)
    assert np.all(sheet[2:10, 12:20] == 20)


@pytest.mark.gpu
def test_renders_on_the_gpu_driver_when_there_is_one():
    with ShaderRenderer(64) as gl:
        assert not any(name in gl.device.lower() for name in ("llvmpipe", "softpipe", "swrast")), gl.device
        first = gl.render_source(generate_program(11).source, time=2.5)
        assert not is_near_constant(first)
        assert gl.render_source(generate_program(11).source, time=2.5).tobytes() == first.tobytes()
