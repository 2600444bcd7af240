"""The headless GL renderer: a real context (moderngl through EGL: Mesa llvmpipe here), Shadertoy uniforms,
byte-identical draws, the near-constant check. Every render is real, at 32 px."""

from __future__ import annotations

import numpy as np
import pytest

from vip_core.synthetic.programs import generate_program
from vip_core.synthetic.renderer import ShaderCompileError, ShaderRenderer, is_near_constant


SIZE = 32

UNIFORMS_PROGRAM = """
void mainImage(out vec4 fragColor, in vec2 fragCoord) {
    vec2 uv = fragCoord / iResolution.xy;
    float frame = float(iFrame) / 600.0;
    float date = (iDate.w - 43200.0) / 10.0 + iDate.x * 0.0 + iMouse.x;
    fragColor = vec4(uv.x, uv.y, fract(iTime / 10.0) * 0.5 + frame * 0.25 + date * 0.25, 1.0);
}
"""

STRIPES_PROGRAM = "void mainImage(out vec4 c, in vec2 f) { c = vec4(step(0.5, fract(f.x / 8.0 + iTime)), 0.2, 0.6, 1.0); }"


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


def test_same_program_and_time_give_byte_identical_images(renderer):
    program = generate_program(7).source
    first = renderer.render_source(program, time=3.5)
    with ShaderRenderer(SIZE) as other:
        second = other.render_source(program, time=3.5)
    assert first.tobytes() == second.tobytes()
    assert renderer.render_source(program, time=6.0).tobytes() != first.tobytes()


def test_a_flat_colour_is_near_constant_and_a_gradient_is_not():
    flat = np.zeros((16, 16, 3), dtype=np.uint8) + np.array([242, 4, 42], dtype=np.uint8)  # far-apart channels
    assert is_near_constant(flat)
    gradient = flat.copy()
    gradient[..., 1] = np.arange(16, dtype=np.uint8)[None, :] * 4
    assert not is_near_constant(gradient)


@pytest.mark.gpu
def test_renders_on_the_gpu_driver_when_there_is_one():
    with ShaderRenderer(64) as gl:
        assert not any(name in gl.device.lower() for name in ("llvmpipe", "softpipe", "swrast")), gl.device
        first = gl.render_source(generate_program(11).source, time=2.5)
        assert not is_near_constant(first)
        assert gl.render_source(generate_program(11).source, time=2.5).tobytes() == first.tobytes()
