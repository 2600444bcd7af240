"""The seeded program generator: thousands of distinct programs that compile and render diverse images."""

from __future__ import annotations

import re

import numpy as np

from vip_core.synthetic.programs import GLSL_LIBRARY, generate_program
from vip_core.synthetic.renderer import is_near_constant


SIZE = 32


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
