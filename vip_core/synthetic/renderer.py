"""Headless rendering of Shadertoy programs with moderngl through EGL.

One :class:`ShaderRenderer` owns one OpenGL context (Mesa llvmpipe on the CPU, or the GPU's driver) and
an RGBA8 framebuffer of ``size`` x ``size``. It draws one full-screen triangle per image with the
Shadertoy uniforms set from the requested time, and reads the pixels back top row first, as Shadertoy
shows them. The context is not shared: each worker process makes its own renderer.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from vip_core.synthetic.shadertoy import VERTEX_SHADER, fragment_shader

logger = logging.getLogger(__name__)

COMPILE_ERROR = "compile_error"
CONSTANT = "constant"

FRAME_RATE = 60.0
# Shadertoy's iDate is (year, month from 0, day, seconds of the day): fixed here, plus iTime, so that an
# image depends only on its program and time.
DATE = (2024.0, 5.0, 15.0, 43_200.0)
# An image whose pixel values spread less than this in every channel (standard deviation over the pixels,
# in 0-255 units) is near-constant: it teaches nothing and is skipped.
MIN_PIXEL_STD = 4.0
# OpenGL renderer names of CPU drivers: a device with another name is a GPU.
SOFTWARE_RENDERERS = ("llvmpipe", "softpipe", "swrast")
MAX_EGL_DEVICES = 16


class GLContextError(RuntimeError):
    """No OpenGL context could be made: EGL or a driver is missing."""


class ShaderCompileError(ValueError):
    """A program that the GL driver refuses to compile or link; the message is the driver's log."""


@dataclass
class CompiledProgram:
    """A linked GL program with the vertex array that draws it."""

    program: Any
    vertex_array: Any

    def release(self) -> None:
        with self.program.ctx:
            self.vertex_array.release()
            self.program.release()


def create_context(device_index: int | None = None) -> Any:
    """A standalone OpenGL >= 4.3 context through EGL (no display needed).

    Args:
        device_index: the EGL device to use; None: ``$GLCONTEXT_DEVICE_INDEX`` if set, else the first
            device with a hardware driver (a GPU), else the first device (Mesa's llvmpipe on the CPU).
    """
    import moderngl

    if device_index is None and "GLCONTEXT_DEVICE_INDEX" not in os.environ:
        device_index = hardware_device_index()
    kwargs = {} if device_index is None else {"device_index": device_index}
    try:
        return moderngl.create_standalone_context(backend="egl", require=430, **kwargs)
    except Exception as error:  # moderngl and glcontext raise plain Exception
        raise GLContextError(
            f"no OpenGL 4.3 context through EGL ({error}); on Debian, `make gl-libs` installs Mesa's EGL and llvmpipe"
        ) from error


@functools.lru_cache(maxsize=1)
def hardware_device_index() -> int | None:
    """The index of the first EGL device whose OpenGL renderer is not a software one; None if none."""
    import moderngl

    for index in range(MAX_EGL_DEVICES):
        try:
            ctx = moderngl.create_standalone_context(backend="egl", require=430, device_index=index)
        except Exception:  # past the last device, or a device without OpenGL 4.3
            continue
        renderer = str(ctx.info["GL_RENDERER"]).lower()
        ctx.release()
        if not any(name in renderer for name in SOFTWARE_RENDERERS):
            return index
    return None


class ShaderRenderer:
    """Renders Shadertoy programs at ``size`` x ``size`` pixels into uint8 RGB arrays.

    Args:
        size: the side of the square image in pixels.
        device_index: the EGL device (see :func:`create_context`).
    """

    def __init__(self, size: int, device_index: int | None = None) -> None:
        if size <= 0:
            raise ValueError(f"image size must be positive, got {size}")
        self.size = size
        self.ctx = create_context(device_index)
        self.framebuffer = self.ctx.framebuffer(color_attachments=[self.ctx.texture((size, size), 4)])
        triangle = np.array([-1.0, -1.0, 3.0, -1.0, -1.0, 3.0], dtype="f4")  # covers the viewport
        self.vertices = self.ctx.buffer(triangle.tobytes())
        logger.debug("GL context: %s", self.ctx.info["GL_RENDERER"])

    @property
    def device(self) -> str:
        """The GL renderer string, e.g. ``llvmpipe (LLVM 15.0.6, 256 bits)``."""
        return str(self.ctx.info["GL_RENDERER"])

    def compile(self, source: str) -> CompiledProgram:
        """Compiles and links the ``mainImage`` program ``source``.

        Raises:
            ShaderCompileError: the driver rejected it.
        """
        import moderngl

        with self.ctx:  # current on this thread, whatever other contexts the process made since
            try:
                program = self.ctx.program(vertex_shader=VERTEX_SHADER, fragment_shader=fragment_shader(source))
            except moderngl.Error as error:
                raise ShaderCompileError(str(error).strip()) from None
            vertex_array = self.ctx.vertex_array(program, [(self.vertices, "2f", "in_position")])
        return CompiledProgram(program, vertex_array)

    def render(self, compiled: CompiledProgram, time: float) -> np.ndarray:
        """The image of ``compiled`` at ``time`` seconds (frame ``time * 60``).

        Returns:
            image: [size, size, 3] uint8, top row first.
        """
        with self.ctx:
            _set_uniforms(compiled.program, self.size, time)
            self.framebuffer.use()
            self.framebuffer.clear(0.0, 0.0, 0.0, 1.0)
            compiled.vertex_array.render()
            pixels = self.framebuffer.read(components=3, alignment=1)
        image = np.frombuffer(pixels, dtype=np.uint8).reshape(self.size, self.size, 3)  # [S, S, 3], bottom row first
        return image[::-1].copy()  # [S, S, 3]

    def render_source(self, source: str, time: float) -> np.ndarray:
        """Compiles ``source``, renders it at ``time`` and releases it: [size, size, 3] uint8."""
        compiled = self.compile(source)
        try:
            return self.render(compiled, time)
        finally:
            compiled.release()

    def release(self) -> None:
        """Frees the framebuffer, the buffers and the context."""
        with self.ctx:
            self.framebuffer.release()
            self.vertices.release()
        self.ctx.release()

    def __enter__(self) -> "ShaderRenderer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _set_uniforms(program: Any, size: int, time: float) -> None:
    frame = int(time * FRAME_RATE)
    values = {
        "iResolution": (float(size), float(size), 1.0),
        "iTime": float(time),
        "iTimeDelta": 1.0 / FRAME_RATE,
        "iFrameRate": FRAME_RATE,
        "iFrame": frame,
        "iMouse": (0.0, 0.0, 0.0, 0.0),
        "iDate": (DATE[0], DATE[1], DATE[2], DATE[3] + float(time)),
        "iSampleRate": 44_100.0,
    }
    for name, value in values.items():
        if name in program:  # the compiler drops uniforms the program does not read
            program[name].value = value


def is_near_constant(image: np.ndarray, min_std: float = MIN_PIXEL_STD) -> bool:
    """Whether ``image`` ([H, W, 3] uint8) is near-constant: in every channel, the standard deviation over
    the pixels is below ``min_std``."""
    per_channel = image.reshape(-1, image.shape[-1]).std(axis=0)  # [3]
    return float(per_channel.max()) < min_std
