"""Which program and time each image gets, and the loop that renders a set of images.

Image ``i`` belongs to program slot ``i // images_per_program``: one compiled program renders all the
images of its slot (compiling costs a CPU renderer hundreds of milliseconds, drawing a frame a few), each
at its own iTime drawn from [0.1, 10]. Slot ``s`` tries programs in order: attempt 0 takes the next
program of a seeded permutation of the pool (every program is used once before any is used twice),
attempt ``a > 0`` a uniform draw. An image keeps the first attempt whose program compiles and whose
image is not near-constant. Every draw is a pure function of (seed, image or slot, attempt), so the
images do not depend on how they are split into shards or workers.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol, Sequence

import numpy as np

from vip_core.synthetic.mixup import convex_mix, mixup_weights
from vip_core.synthetic.programs import ShaderProgram, generate_program
from vip_core.synthetic.renderer import (
    COMPILE_ERROR,
    CONSTANT,
    CompiledProgram,
    ShaderCompileError,
    ShaderRenderer,
    is_near_constant,
)

logger = logging.getLogger(__name__)

TIME_RANGE = (0.1, 10.0)
MAX_ATTEMPTS = 16
UNRENDERED = "unrendered"  # an image none of whose MAX_ATTEMPTS programs rendered

# Distinct streams of the seeded random generator.
_PERMUTATION, _FALLBACK, _TIME, _MIX = 1, 2, 3, 4


class ProgramPool(Protocol):
    """The programs to draw from: a length and indexed access."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> ShaderProgram: ...


class GeneratedPrograms:
    """The generator's programs ``gen-0`` ... ``gen-<count - 1>``, made on demand."""

    def __init__(self, count: int) -> None:
        if count <= 0:
            raise ValueError(f"the program pool needs at least one program, got {count}")
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> ShaderProgram:
        if not 0 <= index < self.count:
            raise IndexError(f"program {index} outside the pool of {self.count}")
        return generate_program(index)


@dataclass(frozen=True)
class RenderPlan:
    """The seeded choices of a render: program per slot and attempt, time per image and attempt."""

    seed: int
    num_images: int
    images_per_program: int
    pool_size: int
    mixup: int = 0

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"render seed must be >= 0, got {self.seed}")
        for name in ("num_images", "images_per_program", "pool_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def slot(self, index: int) -> int:
        return index // self.images_per_program

    def program_index(self, slot: int, attempt: int) -> int:
        """The pool index that ``slot`` tries at ``attempt``."""
        if attempt == 0:
            epoch, position = divmod(slot, self.pool_size)
            return int(_permutation(self.seed, epoch, self.pool_size)[position])
        return int(np.random.default_rng([self.seed, _FALLBACK, slot, attempt]).integers(self.pool_size))

    def time(self, index: int, attempt: int) -> float:
        """The iTime of image ``index`` at ``attempt``, uniform in [0.1, 10]."""
        return float(np.random.default_rng([self.seed, _TIME, index, attempt]).uniform(*TIME_RANGE))

    def mix_partners(self, index: int, candidates: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """The images mixed into output image ``index`` (itself first) and their convex weights.

        Args:
            index: the output image.
            candidates: the other images available to mix with (the rest of its shard).
        """
        rng = np.random.default_rng([self.seed, _MIX, index])
        others = [c for c in candidates if c != index]
        count = self.mixup - 1
        chosen = rng.choice(others, size=count, replace=len(others) < count).tolist() if others and count else []
        partners = [index] + [int(c) for c in chosen]
        return partners, mixup_weights(rng, len(partners))


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, size: int) -> np.ndarray:
    return np.random.default_rng([seed, _PERMUTATION, epoch]).permutation(size)


@dataclass
class RenderedImage:
    """One rendered image and what made it."""

    image: np.ndarray  # [S, S, 3] uint8
    program_id: str
    time: float


@dataclass
class RenderOutcome:
    """The images a :func:`render_images` call made, and the draws it skipped by reason."""

    images: dict[int, RenderedImage] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)


class ProgramCache:
    """Compiled programs of one renderer, most recent first, and the ids that failed to compile."""

    def __init__(self, renderer: ShaderRenderer, capacity: int = 4) -> None:
        self.renderer = renderer
        self.capacity = capacity
        self._compiled: OrderedDict[str, CompiledProgram] = OrderedDict()
        self.failed: set[str] = set()

    def get(self, program: ShaderProgram) -> CompiledProgram | None:
        """The compiled ``program``, or None when it does not compile (logged once)."""
        if program.program_id in self.failed:
            return None
        if program.program_id in self._compiled:
            self._compiled.move_to_end(program.program_id)
            return self._compiled[program.program_id]
        try:
            compiled = self.renderer.compile(program.source)
        except ShaderCompileError as error:
            logger.info("program %s does not compile: %s", program.program_id, str(error)[:300])
            self.failed.add(program.program_id)
            return None
        self._compiled[program.program_id] = compiled
        if len(self._compiled) > self.capacity:
            self._compiled.popitem(last=False)[1].release()
        return compiled

    def release(self) -> None:
        for compiled in self._compiled.values():
            compiled.release()
        self._compiled.clear()


def render_images(cache: ProgramCache, plan: RenderPlan, pool: ProgramPool, indices: Sequence[int]) -> RenderOutcome:
    """Renders images ``indices`` of ``plan``, one compile per slot and attempt.

    Returns:
        the images by index, and the skipped draws: ``compile_error`` counts program draws (per slot and
        attempt), ``constant`` counts near-constant images, ``unrendered`` images that no attempt made.
    """
    outcome = RenderOutcome()
    by_slot: dict[int, list[int]] = {}
    for index in indices:
        by_slot.setdefault(plan.slot(index), []).append(index)
    for slot, members in by_slot.items():
        remaining = members
        for attempt in range(MAX_ATTEMPTS):
            if not remaining:
                break
            remaining = _render_attempt(cache, plan, pool, slot, attempt, remaining, outcome)
        if remaining:
            outcome.skipped[UNRENDERED] += len(remaining)
    return outcome


def _render_attempt(
    cache: ProgramCache, plan: RenderPlan, pool: ProgramPool, slot: int, attempt: int, indices: list[int],
    outcome: RenderOutcome,
) -> list[int]:
    """Renders ``indices`` with the program of (slot, attempt); returns those still without an image."""
    program = pool[plan.program_index(slot, attempt)]
    compiled = cache.get(program)
    if compiled is None:
        outcome.skipped[COMPILE_ERROR] += 1
        return indices
    still_missing = []
    for index in indices:
        time = plan.time(index, attempt)
        image = cache.renderer.render(compiled, time)  # [S, S, 3]
        if is_near_constant(image):
            outcome.skipped[CONSTANT] += 1
            still_missing.append(index)
        else:
            outcome.images[index] = RenderedImage(image, program.program_id, time)
    return still_missing


def mix_images(plan: RenderPlan, rendered: dict[int, RenderedImage]) -> dict[int, tuple[np.ndarray, list[dict]]]:
    """Each image of ``rendered`` mixed with ``plan.mixup - 1`` others of the same set (Shaders21k-MixUp).

    Returns:
        by index: the mixed image ([S, S, 3] uint8) and its components ``{"program", "time", "weight"}``.
    """
    available = sorted(rendered)
    mixed = {}
    for index in available:
        partners, weights = plan.mix_partners(index, available)
        image = convex_mix([rendered[p].image for p in partners], weights)
        components = [
            {"program": rendered[p].program_id, "time": rendered[p].time, "weight": float(w)}
            for p, w in zip(partners, weights)
        ]
        mixed[index] = (image, components)
    return mixed
