"""Procedural objects on photographs: the offline stand-in for private images close to a downstream task.

Each image is one of ten shapes (:data:`SHAPES`) at a random pose (rotation, radius, centre), filled with a
random colour or, with some probability, a photo texture, pasted on a crop of one of the photographs that
scikit-image ships, with colour jitter and pixel noise. The photographs are split by column into regions
(:data:`REGIONS`): the private pre-training images take their backgrounds and textures from one region, the
labelled downstream set from the other, so the two sets share the objects' distribution but no pixels.

Everything is drawn from ``numpy.random.default_rng([seed, region])``: the same seed and region give the same
images. The work is vectorised over chunks of images (about 10 µs an image at 32 px on one core).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

SHAPES = ("circle", "square", "triangle", "diamond", "plus", "ring", "star", "hexagon", "ellipse", "cross")
# The photographs of skimage.data that load without a download (grey ones become three equal channels).
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
          "stereo_motorcycle", "brick", "grass", "gravel", "camera", "moon")
# Which columns of every photograph each region may crop from, as fractions of its width.
REGIONS = {"private": (0.0, 0.6), "downstream": (0.6, 1.0)}
SUPERSAMPLE = 2  # masks are drawn at twice the resolution and averaged: soft edges
CHUNK = 4096


@dataclass(frozen=True)
class ObjectStyle:
    """How the objects are drawn; fractions are of the image side."""

    size: int = 32
    rotation_deg: float = 10.0
    radius: tuple[float, float] = (0.35, 0.45)
    colour_jitter: float = 0.2
    photo_texture: float = 0.2
    pixel_noise: float = 0.02
    background_contrast: float = 0.3  # the backgrounds' deviation from their own mean colour is scaled by this
    photo_side: int = 96  # photographs are scaled so that their short side is this many pixels


def generate_objects(count: int, seed: int, region: str, style: ObjectStyle = ObjectStyle()
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``count`` images ``[count, S, S, 3]`` (uint8) and their shape labels ``[count]`` (int64)."""
    chunks = list(iter_objects(count, seed, region, style))
    if not chunks:
        return np.zeros((0, style.size, style.size, 3), np.uint8), np.zeros(0, np.int64)
    return np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])


def iter_objects(count: int, seed: int, region: str, style: ObjectStyle = ObjectStyle()
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The images of :func:`generate_objects` in chunks of at most 4,096: ``([n, S, S, 3] uint8, [n])``."""
    if region not in REGIONS:
        raise ValueError(f"region: unknown region {region!r} (known: {', '.join(REGIONS)})")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = np.random.default_rng([seed, list(REGIONS).index(region)])
    photos = region_photos(region, style.photo_side)
    for start in range(0, count, CHUNK):
        yield _draw(rng, min(CHUNK, count - start), photos, style)


def _draw(rng: np.random.Generator, n: int, photos: tuple[np.ndarray, ...], style: ObjectStyle
          ) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, len(SHAPES), n)  # [n]
    background = crops(rng, photos, n, style.size)  # [n, S, S, 3]
    mean = background.mean(axis=(1, 2), keepdims=True)  # [n, 1, 1, 3]
    background = mean + style.background_contrast * (background - mean)
    fill = _fills(rng, photos, n, style)  # [n, S, S, 3]
    mask = shape_masks(rng, labels, style)[..., None]  # [n, S, S, 1]
    image = background * (1 - mask) + fill * mask  # [n, S, S, 3]
    jitter = 1 + rng.uniform(-style.colour_jitter, style.colour_jitter, (n, 1, 1, 3)).astype(np.float32)  # gains
    image = image * jitter + style.pixel_noise * rng.standard_normal(image.shape, dtype=np.float32)
    return (np.clip(image, 0, 1) * 255 + 0.5).astype(np.uint8), labels.astype(np.int64)


def _fills(rng: np.random.Generator, photos: tuple[np.ndarray, ...], n: int, style: ObjectStyle) -> np.ndarray:
    """A uniform random colour per object, a photo texture for a fraction ``photo_texture`` of them."""
    colour = rng.uniform(0, 1, (n, 1, 1, 3)).astype(np.float32)  # [n, 1, 1, 3]
    textured = rng.random(n) < style.photo_texture  # [n]
    return np.where(textured[:, None, None, None], crops(rng, photos, n, style.size), colour)  # [n, S, S, 3]


def crops(rng: np.random.Generator, photos: tuple[np.ndarray, ...], n: int, size: int) -> np.ndarray:
    """``n`` random square crops (side 1-2x ``size``) resized to ``size`` (nearest): ``[n, S, S, 3]`` in [0, 1]."""
    which = rng.integers(0, len(photos), n)  # [n]
    out = np.empty((n, size, size, 3), np.float32)
    steps = (np.arange(size) + 0.5) / size  # [S]
    for index, photo in enumerate(photos):
        members = np.flatnonzero(which == index)
        if not len(members):
            continue
        height, width = photo.shape[:2]
        side = rng.uniform(size, min(2 * size, height, width), len(members))  # [m]
        top = rng.uniform(0, height - side)  # [m]
        left = rng.uniform(0, width - side)  # [m]
        rows = (top[:, None] + steps[None] * side[:, None]).astype(np.int64)  # [m, S]
        cols = (left[:, None] + steps[None] * side[:, None]).astype(np.int64)  # [m, S]
        out[members] = photo[rows[:, :, None], cols[:, None, :]]  # [m, S, S, 3]
    return out


def shape_masks(rng: np.random.Generator, labels: np.ndarray, style: ObjectStyle) -> np.ndarray:
    """Soft masks ``[n, S, S]`` in [0, 1] of each label's shape at a random rotation, radius and centre."""
    n, fine = len(labels), style.size * SUPERSAMPLE
    radius = (2 * rng.uniform(*style.radius, n)).astype(np.float32)  # [n], in units of half the image side
    centre = (rng.uniform(-1, 1, (n, 2)) * (1 - radius[:, None]).clip(0) * 0.5).astype(np.float32)  # [n, 2]
    angle = np.deg2rad(rng.uniform(-style.rotation_deg, style.rotation_deg, n)).astype(np.float32)  # [n]
    grid = ((np.arange(fine, dtype=np.float32) + 0.5) / fine * 2 - 1)  # [F], pixel centres in [-1, 1]
    x = (grid[None, None, :] - centre[:, 0, None, None]) / radius[:, None, None]  # [n, 1, F]
    y = (grid[None, :, None] - centre[:, 1, None, None]) / radius[:, None, None]  # [n, F, 1]
    cos, sin = np.cos(angle)[:, None, None], np.sin(angle)[:, None, None]
    u, v = cos * x + sin * y, cos * y - sin * x  # [n, F, F] each, the shape's own frame
    mask = np.zeros((n, fine, fine), np.float32)
    for label, name in enumerate(SHAPES):
        members = labels == label
        if members.any():
            mask[members] = _SHAPE_FUNCTIONS[name](u[members], v[members])
    return mask.reshape(n, style.size, SUPERSAMPLE, style.size, SUPERSAMPLE).mean(axis=(2, 4))  # [n, S, S]


def _polygon(u: np.ndarray, v: np.ndarray, sides: int, phase: float) -> np.ndarray:
    """A regular polygon inscribed in the unit circle: inside every edge's half-plane."""
    inside = np.ones(u.shape, bool)
    for side in range(sides):
        normal = phase + 2 * math.pi * side / sides
        inside &= u * math.cos(normal) + v * math.sin(normal) <= math.cos(math.pi / sides)
    return inside


def _plus(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    arm = 0.33
    return ((abs(u) <= arm) & (abs(v) <= 1)) | ((abs(v) <= arm) & (abs(u) <= 1))


def _star(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return np.hypot(u, v) <= 0.6 + 0.4 * np.cos(5 * np.arctan2(u, -v))  # five points, one up


_SHAPE_FUNCTIONS = {
    "circle": lambda u, v: u * u + v * v <= 1,
    "square": lambda u, v: _polygon(u, v, 4, 0.0),
    "triangle": lambda u, v: _polygon(u, v, 3, math.pi / 2),
    "diamond": lambda u, v: _polygon(u, v, 4, math.pi / 4),
    "plus": _plus,
    "ring": lambda u, v: (u * u + v * v <= 1) & (u * u + v * v >= 0.55 ** 2),
    "star": _star,
    "hexagon": lambda u, v: _polygon(u, v, 6, 0.0),
    "ellipse": lambda u, v: u * u + (v / 0.55) ** 2 <= 1,
    "cross": lambda u, v: _plus((u + v) / math.sqrt(2), (v - u) / math.sqrt(2)),
}


def region_photos(region: str, photo_side: int) -> tuple[np.ndarray, ...]:
    """The columns of every photograph that ``region`` may crop from: ``[H, W', 3]`` float32 arrays in [0, 1]."""
    low, high = REGIONS[region]
    parts = []
    for photo in _photos(photo_side):
        width = photo.shape[1]
        parts.append(photo[:, int(low * width):int(high * width)])
    return tuple(parts)


@functools.lru_cache(maxsize=4)
def _photos(photo_side: int) -> tuple[np.ndarray, ...]:
    """The photographs of :data:`PHOTOS`, RGB, scaled so that their short side is ``photo_side`` (area average)."""
    from PIL import Image
    from skimage import data

    photos = []
    for name in PHOTOS:
        pixels = getattr(data, name)()
        pixels = pixels[0] if isinstance(pixels, tuple) else pixels  # stereo_motorcycle: (left, right, disparity)
        pixels = np.stack([pixels] * 3, axis=-1) if pixels.ndim == 2 else pixels[..., :3]  # [H, W, 3]
        image = Image.fromarray(np.ascontiguousarray(pixels))
        scale = photo_side / min(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BOX)
        photos.append(np.asarray(image, dtype=np.float32) / 255)
    return tuple(photos)
