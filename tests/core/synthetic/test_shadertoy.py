"""Shadertoy programs: single-pass checks and Shadertoy JSON with a common pass."""

from __future__ import annotations

import json

import numpy as np

from vip_core.synthetic.shadertoy import MULTIPASS, NO_MAIN_IMAGE, UNREADABLE, check_program, read_program


STRIPES_PROGRAM = "void mainImage(out vec4 c, in vec2 f) { c = vec4(step(0.5, fract(f.x / 8.0 + iTime)), 0.2, 0.6, 1.0); }"


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
