"""The GL renderer the synthetic-image tests share: one real context (moderngl through EGL) per module, 32 px."""

from __future__ import annotations

import pytest

from vip_core.synthetic.renderer import ShaderRenderer


@pytest.fixture(scope="module")
def renderer():
    with ShaderRenderer(32) as gl:
        yield gl
