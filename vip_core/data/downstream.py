"""The labelled downstream tasks of ``make reproduce``, each a generator of images and labels made offline.

* ``shapes``: the ten shapes of :mod:`vip_core.data.objects` on the photographs' downstream region (the same
  distribution as the private pre-training images, no shared pixels).
* ``textures``: the family of a procedural texture (:data:`TEXTURES`) in two random colours, at a random
  frequency, orientation and phase: a task about local statistics, with no object and no photograph.
* ``counting``: how many discs (1 to 5) lie on a smooth random background, each of a random colour and size:
  a task about how many, not what, of a kind the pre-training images never ask.

Every generator is deterministic per seed (``numpy.random.default_rng([seed, task index])``), draws its
classes exactly balanced (a shuffled round robin; ``shapes`` keeps the object generator's uniform draw) and
returns ``([n, S, S, 3] uint8, [n] int64)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from vip_core.data.objects import SHAPES, ObjectStyle, generate_objects

TEXTURES = ("grating", "checkerboard", "noise-bands", "voronoi", "rings")
COUNTS = ("1", "2", "3", "4", "5")
PIXEL_NOISE = 0.03
CHUNK = 2048
GRID = 3  # counting: discs sit in distinct cells of a 3 x 3 grid, so they never overlap


@dataclass(frozen=True)
class TaskKind:
    """A downstream task: its class names (the ImageFolder folders) and its generator."""

    name: str
    classes: tuple[str, ...]
    description: str
    generate: Callable[[int, int, int], tuple[np.ndarray, np.ndarray]]  # (count, seed, size) -> images, labels


def generate_task(kind: str, count: int, seed: int, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """``count`` images ``[count, S, S, 3]`` (uint8) of task ``kind`` and their labels ``[count]`` (int64)."""
    if kind not in TASK_KINDS:
        raise ValueError(f"task: unknown kind {kind!r} (known: {', '.join(TASK_KINDS)})")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return TASK_KINDS[kind].generate(count, seed, size)


def _shapes(count: int, seed: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    return generate_objects(count, seed, "downstream", ObjectStyle(size=size))


def _chunked(draw: Callable[[np.random.Generator, np.ndarray, int], np.ndarray], classes: int, task: int
             ) -> Callable[[int, int, int], tuple[np.ndarray, np.ndarray]]:
    """A generator drawing balanced labels, then the images of each chunk of at most :data:`CHUNK` labels."""

    def generate(count: int, seed: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([seed, task])
        labels = rng.permutation(np.arange(count) % classes)  # [count], each class count // classes times or one more
        images = [draw(rng, labels[start:start + CHUNK], size) for start in range(0, count, CHUNK)]
        pixels = np.concatenate(images) if images else np.zeros((0, size, size, 3), np.float32)
        return (np.clip(pixels, 0, 1) * 255 + 0.5).astype(np.uint8), labels.astype(np.int64)

    return generate


def _coordinates(n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres in [-1, 1]: ``x`` ``[1, 1, S]`` and ``y`` ``[1, S, 1]``, broadcastable over ``n`` images."""
    grid = (np.arange(size, dtype=np.float32) + 0.5) / size * 2 - 1  # [S]
    return grid[None, None, :], grid[None, :, None]


def _draw_textures(rng: np.random.Generator, labels: np.ndarray, size: int) -> np.ndarray:
    """Each label's texture family as a pattern in [0, 1] mixing two random colours, plus pixel noise."""
    n = len(labels)
    x, y = _coordinates(n, size)
    angle = rng.uniform(0, math.pi, (n, 1, 1)).astype(np.float32)  # [n, 1, 1]
    u = np.cos(angle) * x + np.sin(angle) * y  # [n, S, S], the pattern's own frame
    v = np.cos(angle) * y - np.sin(angle) * x  # [n, S, S]
    frequency = rng.uniform(1.5, 4.0, (n, 1, 1)).astype(np.float32)  # cycles per half image side
    phase = rng.uniform(0, 2 * math.pi, (n, 1, 1)).astype(np.float32)
    patterns = {
        "grating": lambda: 0.5 + 0.5 * np.sin(math.pi * frequency * u + phase),
        "checkerboard": lambda: (np.floor(frequency * u + phase) + np.floor(frequency * v + phase)) % 2,
        "noise-bands": lambda: 0.5 + 0.5 * np.sin(2 * math.pi * 2 * _smooth_noise(rng, n, size) + phase),
        "voronoi": lambda: _voronoi(rng, n, x, y),
        "rings": lambda: 0.5 + 0.5 * np.sin(math.pi * frequency * 2 * np.hypot(
            x - rng.uniform(-0.5, 0.5, (n, 1, 1)), y - rng.uniform(-0.5, 0.5, (n, 1, 1))) + phase),
    }
    pattern = np.zeros((n, size, size), np.float32)
    for label, name in enumerate(TEXTURES):  # every family drawn for all n, kept where the label is its own
        members = labels == label
        pattern[members] = np.broadcast_to(patterns[name](), (n, size, size))[members]
    first, second = (rng.uniform(0, 1, (n, 1, 1, 3)).astype(np.float32) for _ in range(2))  # [n, 1, 1, 3] each
    image = first + (second - first) * pattern[..., None]  # [n, S, S, 3]
    return image + PIXEL_NOISE * rng.standard_normal(image.shape, dtype=np.float32)


def _smooth_noise(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """Value noise: a random 4 x 4 lattice per image, bilinearly interpolated to ``[n, S, S]`` in [0, 1]."""
    lattice = rng.uniform(0, 1, (n, 4, 4)).astype(np.float32)  # [n, 4, 4]
    position = (np.arange(size, dtype=np.float32) + 0.5) / size * 3  # [S], lattice coordinates in [0, 3]
    low = np.minimum(position.astype(np.int64), 2)  # [S]
    weight = position - low  # [S]
    rows = lattice[:, low] * (1 - weight)[None, :, None] + lattice[:, low + 1] * weight[None, :, None]  # [n, S, 4]
    return rows[:, :, low] * (1 - weight) + rows[:, :, low + 1] * weight  # [n, S, S]


def _voronoi(rng: np.random.Generator, n: int, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Cells around 8 random sites, each cell a random level in [0, 1]: ``[n, S, S]``."""
    sites = rng.uniform(-1, 1, (n, 8, 2)).astype(np.float32)  # [n, 8, 2]
    levels = rng.uniform(0, 1, (n, 8)).astype(np.float32)  # [n, 8]
    distance = ((x[..., None] - sites[:, None, None, :, 0]) ** 2
                + (y[..., None] - sites[:, None, None, :, 1]) ** 2)  # [n, S, S, 8]
    nearest = distance.argmin(axis=-1)  # [n, S, S]
    return np.take_along_axis(levels[:, None, :], nearest.reshape(n, 1, -1), axis=2).reshape(nearest.shape)


def _draw_counting(rng: np.random.Generator, labels: np.ndarray, size: int) -> np.ndarray:
    """``label + 1`` discs in distinct cells of a 3 x 3 grid on a smooth two-colour background; the discs are
    brighter only on average (their colours and the background's overlap), so brightness alone gives the count
    only in part."""
    n = len(labels)
    x, y = _coordinates(n, size)
    low, high = (rng.uniform(0, 0.7, (n, 1, 1, 3)).astype(np.float32) for _ in range(2))  # [n, 1, 1, 3] each
    background = low + (high - low) * _smooth_noise(rng, n, size)[..., None]  # [n, S, S, 3]
    order = rng.random((n, GRID * GRID)).argsort(axis=1)  # [n, 9], a random order of the cells per image
    occupied = np.arange(GRID * GRID)[None, :] <= labels[:, None]  # [n, 9], the first label + 1 cells of the order
    cells = np.where(occupied, order, -1)  # [n, 9]
    cell = 2 / GRID
    radius = rng.uniform(0.35, 0.45, (n, GRID * GRID)).astype(np.float32) * cell  # [n, 9]
    jitter = rng.uniform(-1, 1, (n, GRID * GRID, 2)).astype(np.float32) * (cell / 2 - radius[..., None])  # [n, 9, 2]
    colour = rng.uniform(0.3, 1, (n, GRID * GRID, 3)).astype(np.float32)  # [n, 9, 3], brighter on average only
    image = background
    for slot in range(GRID * GRID):
        which = cells[:, slot]  # [n], the cell of this slot's disc, -1 when the image has fewer discs
        centre_x = -1 + cell * (which % GRID + 0.5) + jitter[:, slot, 0]  # [n]
        centre_y = -1 + cell * (which // GRID + 0.5) + jitter[:, slot, 1]  # [n]
        inside = np.hypot(x - centre_x[:, None, None], y - centre_y[:, None, None]) <= radius[:, slot, None, None]
        inside &= (which >= 0)[:, None, None]  # [n, S, S]
        image = np.where(inside[..., None], colour[:, slot, None, None, :], image)  # [n, S, S, 3]
    return image + PIXEL_NOISE * rng.standard_normal(image.shape, dtype=np.float32)


TASK_KINDS: dict[str, TaskKind] = {
    "shapes": TaskKind("shapes", SHAPES, "which of ten shapes, on a photograph", _shapes),
    "textures": TaskKind("textures", TEXTURES, "which procedural texture family", _chunked(_draw_textures, 5, 1)),
    "counting": TaskKind("counting", COUNTS, "how many discs (1 to 5)", _chunked(_draw_counting, 5, 2)),
}
