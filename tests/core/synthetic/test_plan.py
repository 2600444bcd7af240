"""The render plan: broken and constant programs are skipped and counted; draws use the whole pool."""

from __future__ import annotations

from vip_core.synthetic.plan import ProgramCache, RenderPlan, render_images
from vip_core.synthetic.programs import ShaderProgram


BLACK_PROGRAM = "void mainImage(out vec4 c, in vec2 f) { c = vec4(0.0, 0.0, 0.0, 1.0); }"

STRIPES_PROGRAM = "void mainImage(out vec4 c, in vec2 f) { c = vec4(step(0.5, fract(f.x / 8.0 + iTime)), 0.2, 0.6, 1.0); }"


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
