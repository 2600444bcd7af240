"""Shadertoy compatibility: wrap a ``mainImage`` program into a complete fragment shader, and check it.

A Shadertoy program is the code of one "Image" tab: it defines
``void mainImage(out vec4 fragColor, in vec2 fragCoord)`` and reads Shadertoy's uniforms (``iTime``,
``iResolution``, ``iMouse``, ``iDate``, ``iFrame`` ...). Shadertoy compiles it as GLSL ES 3.00 (WebGL 2);
so does :func:`fragment_shader`, which desktop OpenGL 4.3+ (Mesa llvmpipe, NVIDIA) accepts through ES 3
compatibility.

Programs that read ``iChannel0..3`` need other passes (Buffer A-D) or input textures that one pass cannot
supply: :func:`check_program` rejects them, as it rejects sources without ``mainImage``.

Shaders21k ships its Shadertoy programs as ``.fragment`` files holding the Shadertoy API's JSON
(``{"info": ..., "renderpass": [{"type": "image", "code": ...}, ...]}``): :func:`read_program` takes the
code from those, from ``.json`` exports (``{"Shader": {...}}``) and from plain GLSL files.
"""

from __future__ import annotations

import json
import re

GLSL_VERSION = "#version 300 es"

# Reasons a program is skipped; the renderer adds its own (compile errors, near-constant images).
MULTIPASS = "multipass"
NO_MAIN_IMAGE = "no_main_image"
UNREADABLE = "unreadable"

VERTEX_SHADER = f"""{GLSL_VERSION}
in vec2 in_position;
void main() {{
    gl_Position = vec4(in_position, 0.0, 1.0);
}}
"""

# Shadertoy's uniforms, declared as Shadertoy declares them: name -> (type, array suffix).
UNIFORMS: dict[str, tuple[str, str]] = {
    "iResolution": ("vec3", ""),
    "iTime": ("float", ""),
    "iTimeDelta": ("float", ""),
    "iFrameRate": ("float", ""),
    "iFrame": ("int", ""),
    "iChannelTime": ("float", "[4]"),
    "iChannelResolution": ("vec3", "[4]"),
    "iMouse": ("vec4", ""),
    "iDate": ("vec4", ""),
    "iSampleRate": ("float", ""),
}

_HEADER = "\n".join(
    [GLSL_VERSION, "precision highp float;", "precision highp int;"]
    + [f"uniform {kind} {name}{suffix};" for name, (kind, suffix) in UNIFORMS.items()]
    + ["out vec4 vip_FragColor;", "#line 1"]
)

_FOOTER = """
void main() {
    vec4 color = vec4(0.0, 0.0, 0.0, 1.0);
    mainImage(color, gl_FragCoord.xy);
    vip_FragColor = vec4(color.rgb, 1.0);
}
"""

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_MAIN_IMAGE = re.compile(r"\bvoid\s+mainImage\s*\(")
_CHANNEL = re.compile(r"\biChannel[0-3]\b")
_VERSION_LINE = re.compile(r"^\s*#\s*version\b[^\n]*$", re.MULTILINE)
_UNIFORM_LINE = re.compile(
    r"^\s*uniform\s+\w+\s+(?:" + "|".join(UNIFORMS) + r")\b[^;]*;[^\n]*$", re.MULTILINE
)


def strip_comments(source: str) -> str:
    """``source`` without ``//`` and ``/* */`` comments."""
    return _COMMENTS.sub(" ", source)


def check_program(source: str) -> str | None:
    """Why a Shadertoy program cannot be rendered in one pass, or None when it can be tried.

    Returns:
        :data:`NO_MAIN_IMAGE` when the code defines no ``mainImage``; :data:`MULTIPASS` when it reads
        ``iChannel0..3`` (another pass's buffer or an input texture); else None.
    """
    code = strip_comments(source)
    if not _MAIN_IMAGE.search(code):
        return NO_MAIN_IMAGE
    if _CHANNEL.search(code):
        return MULTIPASS
    return None


def fragment_shader(source: str) -> str:
    """The complete GLSL ES 3.00 fragment shader that runs the ``mainImage`` program ``source``.

    A ``#version`` line and re-declarations of Shadertoy's uniforms in ``source`` (exported shaders carry
    them) are dropped; compiler messages keep the line numbers of ``source``.
    """
    body = _VERSION_LINE.sub("", source)
    body = _UNIFORM_LINE.sub("", body)
    return f"{_HEADER}\n{body}\n{_FOOTER}"



def read_program(text: str) -> tuple[str | None, str | None]:
    """The ``mainImage`` code in a program file's ``text``, or why it cannot be rendered in one pass.

    ``text`` is plain GLSL or Shadertoy's JSON. From JSON: the "common" pass's code (shared by every pass)
    followed by the "image" pass's code; a buffer, cubemap or sound pass makes it :data:`MULTIPASS`.

    Returns:
        (code, None) when the program can be tried, else (None, reason).
    """
    code = text
    if text.lstrip().startswith("{"):
        try:
            code = _code_from_shadertoy_json(json.loads(text))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None, UNREADABLE
        if code is None:
            return None, MULTIPASS
    reason = check_program(code)
    return (code, None) if reason is None else (None, reason)


def _code_from_shadertoy_json(data: dict) -> str | None:
    """The common + image code of a one-pass Shadertoy JSON program; None when it has other passes."""
    shader = data.get("Shader", data)
    passes = shader["renderpass"]
    kinds = [render_pass.get("type", "image") for render_pass in passes]
    if kinds.count("image") != 1 or any(kind not in ("image", "common") for kind in kinds):
        return None
    common = "".join(render_pass["code"] + "\n" for render_pass in passes if render_pass.get("type") == "common")
    image = next(render_pass["code"] for render_pass in passes if render_pass.get("type", "image") == "image")
    return common + image
