"""Shadertoy programs: a seeded generator of procedural ``mainImage`` programs, and folders of programs.

:func:`generate_program` writes, from one integer seed, a GLSL program in Shadertoy's form (the form of the
Shaders21k code set, whose codes are not available offline). A program is either a 2-D composition
(domain transforms such as symmetries, tilings and domain warps, then one to three layers of fields such
as fBm noise, ridged noise, Voronoi cells, Julia and Mandelbrot sets, Kaleidoscopic orbit traps, 2-D
signed distances, Truchet tiles, hexagonal tilings, metaballs, grids, roses and sine interference, each
coloured by a cosine palette, HSV ramp or two-colour ramp and blended) or a ray-marched scene of signed-distance primitives combined with smooth
unions, subtractions, repetitions and twists, lit and coloured by a palette over a 2-D background.
Every number is drawn from the seed, so each seed gives its own source; ``random.Random`` keeps
the sources identical across machines and Python versions.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vip_core.synthetic.shadertoy import read_program

logger = logging.getLogger(__name__)

PROGRAM_EXTENSIONS = (".frag", ".glsl", ".fragment", ".json")  # .fragment: Shaders21k's Shadertoy JSON


@dataclass(frozen=True)
class ShaderProgram:
    """A Shadertoy ``mainImage`` program and the id the manifest records for it."""

    program_id: str
    source: str


# ------------------------------------------------------------------------------------------ GLSL library
# Helpers every generated program carries (the compiler drops those a program does not call).

GLSL_LIBRARY = """
#define ZERO min(iFrame, 0)
const float PI = 3.14159265;
const float TAU = 6.28318531;

uint vip_hash(uint x) {
    x ^= x >> 16u; x *= 0x7feb352du; x ^= x >> 15u; x *= 0x846ca68bu; x ^= x >> 16u;
    return x;
}
float hash21(vec2 p) {
    uvec2 q = uvec2(ivec2(floor(p)) + 65536);
    return float(vip_hash(q.x ^ vip_hash(q.y ^ SALT))) * (1.0 / 4294967295.0);
}
vec2 hash22(vec2 p) {
    return vec2(hash21(p), hash21(p + vec2(101.0, 57.0)));
}
float vnoise(vec2 p) {
    vec2 i = floor(p);
    vec2 f = fract(p);
    vec2 u = f * f * (3.0 - 2.0 * f);
    float a = hash21(i);
    float b = hash21(i + vec2(1.0, 0.0));
    float c = hash21(i + vec2(0.0, 1.0));
    float d = hash21(i + vec2(1.0, 1.0));
    return mix(mix(a, b, u.x), mix(c, d, u.x), u.y);
}
float fbm(vec2 p, int octaves) {
    float sum = 0.0;
    float amp = 0.5;
    mat2 m = mat2(1.6, 1.2, -1.2, 1.6);
    for (int i = ZERO; i < octaves; i++) {
        sum += amp * vnoise(p);
        p = m * p;
        amp *= 0.5;
    }
    return sum;
}
float ridged(vec2 p, int octaves) {
    float sum = 0.0;
    float amp = 0.5;
    mat2 m = mat2(1.6, 1.2, -1.2, 1.6);
    for (int i = ZERO; i < octaves; i++) {
        float n = 1.0 - abs(2.0 * vnoise(p) - 1.0);
        sum += amp * n * n;
        p = m * p;
        amp *= 0.5;
    }
    return sum;
}
vec2 voronoi(vec2 p, float t) {
    vec2 cell = floor(p);
    vec2 f = fract(p);
    float d1 = 8.0;
    float d2 = 8.0;
    for (int y = -1 + ZERO; y <= 1; y++) {
        for (int x = -1 + ZERO; x <= 1; x++) {
            vec2 g = vec2(float(x), float(y));
            vec2 o = 0.5 + 0.5 * sin(t + TAU * hash22(cell + g));
            vec2 r = g + o - f;
            float d = dot(r, r);
            if (d < d1) { d2 = d1; d1 = d; } else if (d < d2) { d2 = d; }
        }
    }
    return vec2(sqrt(d1), sqrt(d2));
}
mat2 rot(float a) {
    float c = cos(a);
    float s = sin(a);
    return mat2(c, s, -s, c);
}
vec2 kaleido(vec2 p, float n) {
    float sector = TAU / n;
    float a = mod(atan(p.y, p.x), sector);
    a = abs(a - 0.5 * sector);
    return length(p) * vec2(cos(a), sin(a));
}
vec3 palette(float t, vec3 a, vec3 b, vec3 c, vec3 d) {
    return a + b * cos(TAU * (c * t + d));
}
vec3 hsv2rgb(vec3 c) {
    vec3 rgb = clamp(abs(mod(c.x * 6.0 + vec3(0.0, 4.0, 2.0), 6.0) - 3.0) - 1.0, 0.0, 1.0);
    return c.z * mix(vec3(1.0), rgb, c.y);
}
float escape(vec2 z, vec2 c, int iterations) {
    for (int i = ZERO; i < iterations; i++) {
        z = vec2(z.x * z.x - z.y * z.y, 2.0 * z.x * z.y) + c;
        float r2 = dot(z, z);
        if (r2 > 256.0) {
            return (float(i) - log2(log2(r2)) + 4.0) / float(iterations);
        }
    }
    return 0.0;
}
float kali(vec2 p, vec2 c, int iterations) {
    float trap = 1e3;
    for (int i = ZERO; i < iterations; i++) {
        p = abs(p) / max(dot(p, p), 1e-3) - c;
        trap = min(trap, abs(length(p) - 0.5));
    }
    return exp(-4.0 * trap);
}
vec4 hexTile(vec2 p) {
    const vec2 s = vec2(1.0, 1.7320508);
    vec4 centers = floor(vec4(p, p - vec2(0.5, 1.0)) / s.xyxy) + 0.5;
    vec4 offsets = vec4(p - centers.xy * s, p - (centers.zw + 0.5) * s);
    return dot(offsets.xy, offsets.xy) < dot(offsets.zw, offsets.zw)
        ? vec4(offsets.xy, centers.xy) : vec4(offsets.zw, centers.zw + 0.5);
}
float hexRadius(vec2 p) {
    p = abs(p);
    return max(dot(p, vec2(0.5, 0.8660254)), p.x);
}
float sdBox2(vec2 p, vec2 b) {
    vec2 q = abs(p) - b;
    return length(max(q, 0.0)) + min(max(q.x, q.y), 0.0);
}
float sdSphere(vec3 p, float r) {
    return length(p) - r;
}
float sdBox(vec3 p, vec3 b) {
    vec3 q = abs(p) - b;
    return length(max(q, 0.0)) + min(max(q.x, max(q.y, q.z)), 0.0);
}
float sdTorus(vec3 p, vec2 t) {
    return length(vec2(length(p.xz) - t.x, p.y)) - t.y;
}
float sdOctahedron(vec3 p, float s) {
    p = abs(p);
    return (p.x + p.y + p.z - s) * 0.57735027;
}
float sdCapsule(vec3 p, float h, float r) {
    p.y -= clamp(p.y, -h, h);
    return length(p) - r;
}
float smin(float a, float b, float k) {
    float h = clamp(0.5 + 0.5 * (b - a) / k, 0.0, 1.0);
    return mix(b, a, h) - k * h * (1.0 - h);
}
"""


# ----------------------------------------------------------------------------------------------- helpers


def _f(value: float, digits: int = 3) -> str:
    """A GLSL float literal, parenthesised when negative."""
    text = f"{value:.{digits}f}"
    return f"({text})" if value < 0 else text


def _vec(*values: float) -> str:
    return f"vec{len(values)}({', '.join(_f(v) for v in values)})"


class _Builder:
    """The statements of a function body, with fresh variable names and the seed's random numbers."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.lines: list[str] = []
        self._names = 0

    def name(self, stem: str) -> str:
        """A GLSL variable name not used before in this body."""
        self._names += 1
        return f"{stem}{self._names}"

    def emit(self, line: str) -> None:
        """Appends one statement."""
        self.lines.append(f"    {line}")

    def u(self, low: float, high: float) -> float:
        """A uniform number in [low, high]."""
        return self.rng.uniform(low, high)

    def signed(self, low: float, high: float) -> float:
        """A number whose magnitude is uniform in [low, high] and whose sign is random."""
        return self.rng.choice((-1.0, 1.0)) * self.rng.uniform(low, high)

    def i(self, low: int, high: int) -> int:
        """A uniform integer in [low, high]."""
        return self.rng.randint(low, high)

    def time(self, scale: float = 1.0) -> str:
        """``t`` times a random signed speed: motion for the ``iTime`` axis."""
        return f"t * {_f(self.signed(0.05, 1.0) * scale)}"


# ----------------------------------------------------------------------------------- 2-D domain transforms


def _rotate(b: _Builder, p: str) -> None:
    b.emit(f"{p} = rot({_f(b.u(0, 6.283))} + {b.time(0.5)}) * {p};")


def _kaleidoscope(b: _Builder, p: str) -> None:
    b.emit(f"{p} = kaleido({p}, {b.i(3, 12)}.0);")


def _mirror(b: _Builder, p: str) -> None:
    b.emit(b.rng.choice((f"{p} = abs({p});", f"{p}.x = abs({p}.x);", f"{p}.y = abs({p}.y);")))


def _tile(b: _Builder, p: str) -> None:
    cells = b.u(1.5, 4.0)
    b.emit(f"{p} = (fract({p} * {_f(cells / 2)} + 0.5) - 0.5) * 2.0;")


def _polar(b: _Builder, p: str) -> None:
    b.emit(f"{p} = vec2(atan({p}.y, {p}.x) / TAU * {b.i(1, 8)}.0, length({p}) * {_f(b.u(0.5, 3.0))} + {b.time()});")


def _warp_noise(b: _Builder, p: str) -> None:
    scale, amount = b.u(0.5, 3.0), b.u(0.3, 2.0)
    b.emit(
        f"{p} += {_f(amount)} * (vec2(fbm({p} * {_f(scale)} + {b.time()}, 4), "
        f"fbm({p} * {_f(scale)} + vec2({_f(b.u(1, 9))}, {_f(b.u(1, 9))}) + {b.time()}, 4)) - 0.5);"
    )


def _warp_sine(b: _Builder, p: str) -> None:
    b.emit(f"{p} += {_f(b.u(0.1, 0.6))} * sin({p}.yx * {_f(b.u(1.0, 6.0))} + {b.time(2.0)});")


def _swirl(b: _Builder, p: str) -> None:
    b.emit(f"{p} = rot(length({p}) * {_f(b.signed(0.5, 4.0))} + {b.time()}) * {p};")


def _inversion(b: _Builder, p: str) -> None:
    b.emit(f"{p} = {p} / max(dot({p}, {p}), 0.05) * {_f(b.u(0.3, 1.5))};")


def _folds(b: _Builder, p: str) -> None:
    offset, angle = _vec(b.u(0.1, 0.8), b.u(0.1, 0.8)), b.u(0.1, 3.0)
    b.emit(f"for (int i = ZERO; i < {b.i(2, 6)}; i++) {{ {p} = rot({_f(angle)} + {b.time(0.2)}) * (abs({p}) - {offset}); }}")


DOMAIN_TRANSFORMS: dict[str, Callable[[_Builder, str], None]] = {
    "rotate": _rotate,
    "kaleidoscope": _kaleidoscope,
    "mirror": _mirror,
    "tile": _tile,
    "polar": _polar,
    "warp_noise": _warp_noise,
    "warp_sine": _warp_sine,
    "swirl": _swirl,
    "inversion": _inversion,
    "folds": _folds,
}


# ---------------------------------------------------------------------------------------- 2-D fields
# Each writes statements and returns a float expression, roughly in [0, 1], of the point ``q``.


def _field_fbm(b: _Builder, q: str) -> str:
    return f"fbm({q} * {_f(b.u(1.0, 4.0))} + vec2({b.time()}, {b.time()}), {b.i(3, 7)})"


def _field_ridged(b: _Builder, q: str) -> str:
    return f"ridged({q} * {_f(b.u(1.0, 4.0))} + vec2({b.time()}, {b.time()}), {b.i(3, 6)})"


def _field_warped_fbm(b: _Builder, q: str) -> str:
    w = b.name("w")
    scale = _f(b.u(1.0, 4.0))
    b.emit(f"vec2 {w} = vec2(fbm({q} * {scale} + {b.time()}, 4), fbm({q} * {scale} + {_vec(5.2, 1.3)}, 4));")
    return f"fbm({q} * {scale} + {_f(b.u(1.0, 4.0))} * {w} + {b.time()}, 5)"


def _field_voronoi(b: _Builder, q: str) -> str:
    v = b.name("vor")
    b.emit(f"vec2 {v} = voronoi({q} * {_f(b.u(2.0, 6.0))}, {b.time(3.0)});")
    return b.rng.choice((f"{v}.x", f"smoothstep(0.0, {_f(b.u(0.05, 0.4))}, {v}.y - {v}.x)", f"{v}.y * {v}.x * 2.0"))


def _field_sines(b: _Builder, q: str) -> str:
    terms = []
    for _ in range(b.i(2, 5)):
        direction = _vec(b.signed(0.2, 1.0), b.signed(0.2, 1.0))
        terms.append(f"sin(dot({q}, {direction}) * {_f(b.u(2.0, 10.0))} + {b.time(3.0)})")
    return f"0.5 + 0.5 * ({' + '.join(terms)}) / {len(terms)}.0"


def _field_rings(b: _Builder, q: str) -> str:
    center = _vec(b.signed(0.0, 0.5), b.signed(0.0, 0.5))
    return f"0.5 + 0.5 * sin(length({q} - {center}) * {_f(b.u(4.0, 20.0))} - {b.time(4.0)})"


def _field_stripes(b: _Builder, q: str) -> str:
    angle = b.u(0.0, 3.1416)
    sharp = b.u(1.0, 8.0)
    return (
        f"smoothstep(-1.0, 1.0, {_f(sharp)} * sin(dot({q}, {_vec(math.cos(angle), math.sin(angle))}) * "
        f"{_f(b.u(3.0, 15.0))} + {b.time(3.0)}))"
    )


def _field_checker(b: _Builder, q: str) -> str:
    cell = b.name("cell")
    b.emit(f"vec2 {cell} = floor({q} * {_f(b.u(2.0, 8.0))});")
    return f"mix(mod({cell}.x + {cell}.y, 2.0), hash21({cell}), {_f(b.u(0.0, 1.0))})"


def _field_julia(b: _Builder, q: str) -> str:
    c = _vec(b.signed(0.3, 0.8), b.signed(0.1, 0.7))
    wobble = _f(b.u(0.01, 0.1))
    return f"escape({q} * {_f(b.u(0.8, 1.8))}, {c} + {wobble} * vec2(cos({b.time()}), sin({b.time()})), {b.i(32, 96)})"


_MANDELBROT_SPOTS = ((-0.745, 0.113), (-0.1011, 0.9563), (-1.2507, 0.0201), (-0.7269, 0.1889), (0.2501, 0.0), (-1.768, 0.001))


def _field_mandelbrot(b: _Builder, q: str) -> str:
    x, y = b.rng.choice(_MANDELBROT_SPOTS)
    zoom = 10 ** b.u(-2.5, -0.2)
    return f"escape(vec2(0.0), {q} * {_f(zoom, 6)} + vec2({_f(x, 4)}, {_f(y, 4)}), {b.i(48, 128)})"


def _field_kali(b: _Builder, q: str) -> str:
    c = _vec(b.u(0.3, 1.0), b.u(0.3, 1.0))
    return f"kali({q} * {_f(b.u(0.5, 2.0))}, {c} + {_f(b.u(0.0, 0.1))} * sin({b.time()}), {b.i(6, 14)})"


def _field_shapes(b: _Builder, q: str) -> str:
    d = b.name("d")
    shapes = []
    for _ in range(b.i(1, 4)):
        center = _vec(b.signed(0.0, 0.7), b.signed(0.0, 0.7))
        if b.rng.random() < 0.5:
            shapes.append(f"length({q} - {center}) - {_f(b.u(0.1, 0.6))}")
        else:
            shapes.append(f"sdBox2(rot({b.time()}) * ({q} - {center}), {_vec(b.u(0.05, 0.5), b.u(0.05, 0.5))})")
    b.emit(f"float {d} = {shapes[0]};")
    for shape in shapes[1:]:
        b.emit(f"{d} = smin({d}, {shape}, {_f(b.u(0.05, 0.4))});")
    if b.rng.random() < 0.5:
        return f"0.5 + 0.5 * sin({d} * {_f(b.u(10.0, 40.0))} - {b.time(4.0)})"
    return f"smoothstep({_f(b.u(0.01, 0.2))}, 0.0, abs({d}))"


def _field_truchet(b: _Builder, q: str) -> str:
    g, local = b.name("g"), b.name("local")
    b.emit(f"vec2 {g} = {q} * {_f(b.u(3.0, 8.0))};")
    b.emit(f"vec2 {local} = fract({g}) - 0.5;")
    b.emit(f"if (hash21({g}) < 0.5) {local}.x = -{local}.x;")
    b.emit(f"{local} -= 0.5 * sign({local}.x + {local}.y + 1e-4);")
    return f"smoothstep({_f(b.u(0.05, 0.2))}, 0.0, abs(length({local}) - 0.5))"


def _field_plasma(b: _Builder, q: str) -> str:
    k = [_f(b.u(1.0, 8.0)) for _ in range(4)]
    return (
        f"0.5 + 0.125 * (sin({q}.x * {k[0]} + {b.time(2.0)}) + sin({q}.y * {k[1]} + {b.time(2.0)}) + "
        f"sin(({q}.x + {q}.y) * {k[2]} + {b.time(2.0)}) + sin(length({q}) * {k[3]} + {b.time(2.0)}))"
    )


def _field_hexagons(b: _Builder, q: str) -> str:
    h = b.name("hex")
    b.emit(f"vec4 {h} = hexTile({q} * {_f(b.u(2.0, 7.0))});")
    edge = f"smoothstep({_f(b.u(0.3, 0.48))}, 0.5, hexRadius({h}.xy))"
    return f"mix({edge}, hash21({h}.zw * 2.0 + 0.5), {_f(b.u(0.0, 0.8))})"


def _field_metaballs(b: _Builder, q: str) -> str:
    m = b.name("meta")
    b.emit(f"float {m} = 0.0;")
    for _ in range(b.i(3, 7)):
        center = (
            f"vec2({_f(b.u(0.2, 0.9))} * sin({b.time(1.5)} + {_f(b.u(0, 6.283))}), "
            f"{_f(b.u(0.2, 0.9))} * cos({b.time(1.5)} + {_f(b.u(0, 6.283))}))"
        )
        b.emit(f"{m} += {_f(b.u(0.01, 0.06))} / max(dot({q} - {center}, {q} - {center}), 1e-4);")
    return f"smoothstep({_f(b.u(0.4, 0.9))}, {_f(b.u(1.0, 1.6))}, {m})"


def _field_grid(b: _Builder, q: str) -> str:
    g = b.name("grid")
    b.emit(f"vec2 {g} = abs(fract({q} * {_f(b.u(2.0, 8.0))}) - 0.5);")
    return f"smoothstep({_f(b.u(0.02, 0.15))}, 0.0, min({g}.x, {g}.y))"


def _field_rose(b: _Builder, q: str) -> str:
    radius = f"(0.5 + {_f(b.u(0.1, 0.4))} * cos({b.i(2, 9)}.0 * atan({q}.y, {q}.x) + {b.time(2.0)}))"
    return f"smoothstep({_f(b.u(0.05, 0.3))}, 0.0, abs(length({q}) - {radius}))"


FIELDS: dict[str, Callable[[_Builder, str], str]] = {
    "fbm": _field_fbm,
    "ridged": _field_ridged,
    "warped_fbm": _field_warped_fbm,
    "voronoi": _field_voronoi,
    "sines": _field_sines,
    "rings": _field_rings,
    "stripes": _field_stripes,
    "checker": _field_checker,
    "julia": _field_julia,
    "mandelbrot": _field_mandelbrot,
    "kali": _field_kali,
    "shapes": _field_shapes,
    "truchet": _field_truchet,
    "plasma": _field_plasma,
    "hexagons": _field_hexagons,
    "metaballs": _field_metaballs,
    "grid": _field_grid,
    "rose": _field_rose,
}


# ------------------------------------------------------------------------------------- colour and blending


def _palette_args(b: _Builder) -> str:
    a = _vec(*(b.u(0.35, 0.65) for _ in range(3)))
    amplitude = _vec(*(b.u(0.25, 0.5) for _ in range(3)))
    frequency = _vec(*([b.u(0.5, 2.0)] * 3 if b.rng.random() < 0.5 else [b.u(0.3, 2.0) for _ in range(3)]))
    phase = _vec(*(b.u(0.0, 1.0) for _ in range(3)))
    return f"{a}, {amplitude}, {frequency}, {phase}"


def _colorize(b: _Builder, value: str) -> str:
    """A vec3 expression colouring the float ``value``."""
    style = b.rng.random()
    if style < 0.55:
        return f"palette({value} * {_f(b.u(0.5, 3.0))} + {_f(b.u(0, 1))} + {b.time(0.3)}, {_palette_args(b)})"
    if style < 0.8:
        return (
            f"hsv2rgb(vec3({value} * {_f(b.signed(0.2, 1.5))} + {_f(b.u(0, 1))} + {b.time(0.2)}, "
            f"{_f(b.u(0.4, 1.0))}, {_f(b.u(0.5, 1.0))} * (0.4 + 0.6 * {value})))"
        )
    if style < 0.95:
        dark, light = _vec(*(b.u(0.0, 0.5) for _ in range(3))), _vec(*(b.u(0.5, 1.0) for _ in range(3)))
        return f"mix({dark}, {light}, smoothstep({_f(b.u(0.0, 0.4))}, {_f(b.u(0.6, 1.0))}, {value}))"
    return f"vec3(pow(clamp({value}, 0.0, 1.0), {_f(b.u(0.5, 2.0))})) * {_vec(*(b.u(0.7, 1.0) for _ in range(3)))}"


_BLENDS = (
    "col = col + {c} * {w};",
    "col = col * mix(vec3(1.0), 1.6 * {c}, {w});",
    "col = mix(col, {c}, smoothstep(0.35, 0.65, {v}));",
    "col = 1.0 - (1.0 - col) * (1.0 - {c} * {w});",
    "col = abs(col - {c} * {w});",
    "col = max(col, {c} * {w});",
    "col = mix(col, {c}, {w});",
)


def _post(b: _Builder) -> None:
    if b.rng.random() < 0.4:
        b.emit(f"col *= 1.0 - {_f(b.u(0.05, 0.35))} * dot(uv, uv);")
    if b.rng.random() < 0.4:
        b.emit("col = smoothstep(0.0, 1.0, clamp(col, 0.0, 1.0));")
    if b.rng.random() < 0.3:
        b.emit(f"col = mix(vec3(dot(col, vec3(0.299, 0.587, 0.114))), col, {_f(b.u(0.5, 1.6))});")
    b.emit(f"col = pow(clamp(col, 0.0, 1.0), vec3({_f(b.u(0.7, 1.3))}));")


# ---------------------------------------------------------------------------------------------- programs


def _main_image(b: _Builder, helpers: str = "") -> str:
    body = "\n".join(b.lines)
    return f"{helpers}void mainImage(out vec4 fragColor, in vec2 fragCoord) {{\n{body}\n}}\n"


def _begin(b: _Builder) -> None:
    b.emit("vec2 uv = (2.0 * fragCoord - iResolution.xy) / iResolution.y;")
    b.emit(f"float t = iTime * {_f(b.u(0.2, 1.5))};")


def _composition(b: _Builder) -> str:
    """A 2-D program: domain transforms, then one to three coloured, blended field layers."""
    _begin(b)
    b.emit(f"vec2 p = uv * {_f(b.u(0.6, 2.0))} + {_vec(b.signed(0, 0.5), b.signed(0, 0.5))};")
    for name in b.rng.sample(sorted(DOMAIN_TRANSFORMS), b.i(0, 3)):
        DOMAIN_TRANSFORMS[name](b, "p")
    b.emit("vec3 col = vec3(0.0);")
    for layer in range(b.i(1, 3)):
        q, v = b.name("q"), b.name("v")
        b.emit(f"vec2 {q} = rot({_f(b.u(0, 6.283))}) * p * {_f(b.u(0.5, 1.5))} + {_vec(b.signed(0, 1), b.signed(0, 1))};")
        if b.rng.random() < 0.3:
            DOMAIN_TRANSFORMS[b.rng.choice(sorted(DOMAIN_TRANSFORMS))](b, q)
        b.emit(f"float {v} = {FIELDS[b.rng.choice(sorted(FIELDS))](b, q)};")
        color = _colorize(b, v)
        if layer == 0:
            b.emit(f"col = {color};")
        else:
            blend = b.rng.choice(_BLENDS)
            b.emit(blend.format(c=f"({color})", w=_f(b.u(0.3, 1.0)), v=v))
    _post(b)
    b.emit("fragColor = vec4(col, 1.0);")
    return _main_image(b)


def _primitive(b: _Builder, p: str) -> str:
    offset = _vec(b.signed(0, 0.8), b.signed(0, 0.8), b.signed(0, 0.8))
    local = f"({p} - {offset})"
    kind = b.rng.randrange(5)
    if kind == 0:
        return f"sdSphere({local}, {_f(b.u(0.3, 0.9))})"
    if kind == 1:
        return f"sdBox({local}, {_vec(b.u(0.2, 0.7), b.u(0.2, 0.7), b.u(0.2, 0.7))}) - {_f(b.u(0.0, 0.1))}"
    if kind == 2:
        return f"sdTorus({local}, {_vec(b.u(0.4, 0.8), b.u(0.08, 0.25))})"
    if kind == 3:
        return f"sdOctahedron({local}, {_f(b.u(0.4, 1.0))})"
    return f"sdCapsule({local}, {_f(b.u(0.2, 0.6))}, {_f(b.u(0.1, 0.3))})"


def _scene_function(b: _Builder) -> str:
    """``float map(vec3 p)``: primitives combined by smooth union, union, subtraction or intersection."""
    scene = _Builder(b.rng)
    if b.rng.random() < 0.6:
        scene.emit(f"p.xz = rot({scene.time(0.5)}) * p.xz;")
    if b.rng.random() < 0.3:
        scene.emit(f"p.xy = rot(p.y * {_f(scene.signed(0.3, 1.5))}) * p.xy;")
    if b.rng.random() < 0.35:
        period = _f(scene.u(1.8, 3.5))
        axes = b.rng.choice(("xz", "xyz", "x", "xy"))
        scene.emit(f"p.{axes} = mod(p.{axes} + 0.5 * {period}, {period}) - 0.5 * {period};")
    if b.rng.random() < 0.3:
        scene.emit(f"p = abs(p) - {_vec(*(scene.u(0.0, 0.5) for _ in range(3)))};")
    scene.emit(f"float d = {_primitive(scene, 'p')};")
    for _ in range(b.i(1, 3)):
        shape = _primitive(scene, "p")
        scene.emit(
            b.rng.choice(
                (
                    f"d = smin(d, {shape}, {_f(scene.u(0.1, 0.5))});",
                    f"d = min(d, {shape});",
                    f"d = max(d, -({shape}));",
                    f"d = max(d, {shape});",
                )
            )
        )
    if b.rng.random() < 0.3:
        scene.emit(f"d += {_f(scene.u(0.01, 0.05))} * sin({_f(scene.u(5, 20))} * p.x) * sin({_f(scene.u(5, 20))} * p.y);")
    scene.emit("return d;")
    body = "\n".join(scene.lines)
    return (
        f"float map(vec3 p) {{\n    float t = iTime * {_f(b.u(0.2, 1.2))};\n{body}\n}}\n"
        "vec3 normalAt(vec3 p) {\n"
        "    vec3 n = vec3(0.0);\n"
        "    for (int i = ZERO; i < 4; i++) {\n"
        "        vec3 e = 0.5773 * (2.0 * vec3(float(((i + 3) >> 1) & 1), float((i >> 1) & 1), float(i & 1)) - 1.0);\n"
        "        n += e * map(p + 0.002 * e);\n"
        "    }\n"
        "    return normalize(n);\n"
        "}\n"
    )


def _raymarch(b: _Builder) -> str:
    """A 3-D program: an orbiting camera ray-marches a signed-distance scene over a 2-D background."""
    helpers = _scene_function(b)
    _begin(b)
    radius, height, angle = b.u(2.8, 4.5), b.signed(0.0, 2.0), b.u(0, 6.283)
    b.emit(f"float orbit = {_f(angle)} + {b.time(0.5)};")
    b.emit(f"vec3 ro = vec3({_f(radius)} * cos(orbit), {_f(height)}, {_f(radius)} * sin(orbit));")
    b.emit("vec3 ww = normalize(-ro);")
    b.emit("vec3 uu = normalize(cross(ww, vec3(0.0, 1.0, 0.0)));")
    b.emit("vec3 vv = cross(uu, ww);")
    b.emit(f"vec3 rd = normalize(uv.x * uu + uv.y * vv + {_f(b.u(1.2, 2.5))} * ww);")
    background = FIELDS[b.rng.choice(("fbm", "sines", "plasma", "rings", "voronoi", "stripes"))](b, "uv")
    b.emit(f"float bgv = {background};")
    b.emit(f"vec3 bg = {_colorize(b, 'bgv')} * {_f(b.u(0.5, 1.0))};")
    b.emit("float dist = 0.0;")
    b.emit("float steps = 0.0;")
    b.emit("bool hit = false;")
    b.emit(f"for (int i = ZERO; i < {b.i(48, 96)}; i++) {{")
    b.emit("    float h = map(ro + rd * dist);")
    b.emit("    if (abs(h) < 0.001 * (1.0 + dist)) { hit = true; break; }")
    b.emit(f"    dist += h * {_f(b.u(0.6, 0.9))};")
    b.emit("    steps += 1.0;")
    b.emit("    if (dist > 20.0) break;")
    b.emit("}")
    b.emit("vec3 col = bg;")
    b.emit("if (hit) {")
    b.emit("    vec3 pos = ro + rd * dist;")
    b.emit("    vec3 n = normalAt(pos);")
    b.emit(f"    vec3 light = normalize({_vec(b.signed(0.2, 1.0), b.u(0.3, 1.0), b.signed(0.2, 1.0))});")
    b.emit("    float diffuse = clamp(dot(n, light), 0.0, 1.0);")
    b.emit("    float ambient = 0.5 + 0.5 * n.y;")
    b.emit(f"    float specular = pow(clamp(dot(reflect(rd, n), light), 0.0, 1.0), {_f(b.u(4.0, 64.0))});")
    key = b.rng.choice(("dot(n, vec3(0.577))", "length(pos)", "pos.y", "steps * 0.02", "dot(pos, n)"))
    b.emit(f"    vec3 base = palette({key} * {_f(b.u(0.3, 2.0))} + {_f(b.u(0, 1))}, {_palette_args(b)});")
    b.emit("    col = base * (0.4 * ambient + 0.8 * diffuse) + 0.4 * specular;")
    b.emit(f"    col = mix(col, bg, 1.0 - exp({_f(-b.u(0.002, 0.03), 4)} * dist * dist));")
    b.emit("} else {")
    b.emit(f"    col += {_f(b.u(0.0, 0.6))} * steps / 96.0 * {_vec(*(b.u(0.3, 1.0) for _ in range(3)))};")
    b.emit("}")
    _post(b)
    b.emit("fragColor = vec4(col, 1.0);")
    return _main_image(b, helpers)


RAYMARCH_SHARE = 0.3


def generate_program(seed: int) -> ShaderProgram:
    """The procedural program of ``seed`` (any non-negative integer), id ``gen-<seed>``.

    The same seed gives the same source on every machine; different seeds give different sources.
    """
    if seed < 0:
        raise ValueError(f"program seed must be >= 0, got {seed}")
    rng = random.Random(seed)
    builder = _Builder(rng)
    body = _raymarch(builder) if rng.random() < RAYMARCH_SHARE else _composition(builder)
    header = f"// vip procedural program {seed}\nconst uint SALT = {rng.getrandbits(32)}u;\n"
    return ShaderProgram(program_id=f"gen-{seed}", source=header + GLSL_LIBRARY + "\n" + body)


# ------------------------------------------------------------------------------------------------ folders


def load_program_folder(folder: str | Path) -> tuple[list[ShaderProgram], dict[str, int]]:
    """The renderable programs in the program files under ``folder``, and those left out.

    Program files are GLSL (``.frag``, ``.glsl``) or Shadertoy JSON (``.json``, Shaders21k's ``.fragment``),
    see :func:`~vip_core.synthetic.shadertoy.read_program`.

    Returns:
        programs: one per usable file, ids are the paths relative to ``folder``, in sorted order.
        excluded: the number of files left out by reason (see :func:`read_program`).

    Raises:
        FileNotFoundError: ``folder`` does not exist or holds no program file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"shader folder {folder} does not exist")
    files = sorted(path for path in folder.rglob("*") if path.is_file() and path.suffix in PROGRAM_EXTENSIONS)
    if not files:
        raise FileNotFoundError(f"shader folder {folder} holds no program file ({', '.join(PROGRAM_EXTENSIONS)})")
    programs: list[ShaderProgram] = []
    excluded: dict[str, int] = {}
    for path in files:
        source, reason = read_program(path.read_text(encoding="utf-8", errors="replace"))
        if source is not None:
            programs.append(ShaderProgram(program_id=path.relative_to(folder).as_posix(), source=source))
        else:
            excluded[str(reason)] = excluded.get(str(reason), 0) + 1
            logger.info("skipping %s: %s", path, reason)
    return programs, excluded
