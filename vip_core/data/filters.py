"""Checks on downloaded web images: is the body a usable image, and does the sample pass the filters.

Two kinds of verdict, each a short reason string (``None`` means "passes"):

- :func:`decode_web_image` turns a downloaded body into an RGB image or a *failure* reason (empty body,
  HTML served as an image, truncated or corrupt data, a decompression bomb). A failed row was never a
  usable download.
- :class:`SampleFilter` gives the *filter* reason for a usable image: the NSFW tag, the minimum side,
  the aspect ratio, and any column condition of the configuration (``"similarity >= 0.28"``).
"""

from __future__ import annotations

import io
import math
import operator
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from PIL import Image, ImageOps, UnidentifiedImageError

NSFW_TAG_COLUMNS = ("nsfw",)
PUNSAFE_COLUMNS = ("punsafe",)
NSFW_TAG_VALUES = frozenset({"nsfw"})

_OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
}
_CONDITION = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*(>=|<=|==|!=|>|<)\s*(.+?)\s*$")


@dataclass(frozen=True)
class Condition:
    """A row filter ``column op value``; rows whose value is missing fail it."""

    column: str
    op: str
    value: float | str
    text: str

    def holds(self, row: Mapping[str, Any]) -> bool:
        """Whether ``row`` (column name to value) satisfies the condition."""
        actual = row.get(self.column)
        if actual is None or (isinstance(actual, float) and math.isnan(actual)):
            return False
        if isinstance(self.value, float):
            try:
                actual = float(actual)
            except (TypeError, ValueError):
                return False
        else:
            actual = str(actual)
        return _OPERATORS[self.op](actual, self.value)


def parse_condition(text: str) -> Condition:
    """Parses ``"similarity >= 0.28"`` or ``"LICENSE != '?'"``; a bad condition raises ValueError."""
    match = _CONDITION.match(text)
    if match is None:
        raise ValueError(f"condition {text!r} is not of the form 'column op value' with op one of {list(_OPERATORS)}")
    column, op, literal = match.groups()
    return Condition(column=column, op=op, value=_parse_literal(literal, text), text=text.strip())


def _parse_literal(literal: str, text: str) -> float | str:
    if len(literal) >= 2 and literal[0] == literal[-1] and literal[0] in "'\"":
        return literal[1:-1]
    try:
        return float(literal)
    except ValueError:
        raise ValueError(f"condition {text!r}: value {literal!r} is neither a number nor a quoted string") from None


@dataclass(frozen=True)
class SampleFilter:
    """The filters a usable image must pass, in the order their reasons are reported.

    Args:
        min_side: smallest allowed width and height of the original image, in pixels.
        max_aspect_ratio: largest allowed long side / short side.
        drop_nsfw: drop rows tagged ``NSFW`` (LAION's NSFW column) or with punsafe above ``max_punsafe``.
        max_punsafe: the punsafe threshold.
        conditions: extra row conditions; a failing row is reported as ``condition: <text>``.
    """

    min_side: int
    max_aspect_ratio: float
    drop_nsfw: bool = True
    max_punsafe: float = 0.5
    conditions: tuple[Condition, ...] = ()

    @classmethod
    def from_texts(cls, conditions: Sequence[str] = (), **settings: Any) -> "SampleFilter":
        """A filter whose conditions are given as text."""
        return cls(conditions=tuple(parse_condition(text) for text in conditions), **settings)

    def reason(self, row: Mapping[str, Any], width: int, height: int) -> str | None:
        """Why the sample is filtered out (``"nsfw"``, ``"condition: ..."``, ``"min_side"``,
        ``"aspect_ratio"``), or None if it passes. ``row`` maps the url list's columns to values."""
        if self.drop_nsfw and is_nsfw(row, self.max_punsafe):
            return "nsfw"
        for condition in self.conditions:
            if not condition.holds(row):
                return f"condition: {condition.text}"
        if min(width, height) < self.min_side:
            return "min_side"
        if max(width, height) / min(width, height) > self.max_aspect_ratio:
            return "aspect_ratio"
        return None


def is_nsfw(row: Mapping[str, Any], max_punsafe: float) -> bool:
    """Whether a LAION row is tagged NSFW (``NSFW == "NSFW"``) or has ``punsafe > max_punsafe``."""
    for name, value in row.items():
        if value is None:
            continue
        lowered = name.lower()
        if lowered in NSFW_TAG_COLUMNS and str(value).strip().lower() in NSFW_TAG_VALUES:
            return True
        if lowered in PUNSAFE_COLUMNS:
            try:
                if float(value) > max_punsafe:
                    return True
            except (TypeError, ValueError):
                continue
    return False


def decode_web_image(body: bytes, max_pixels: int, draft_size: int | None = None) -> tuple[Image.Image | None, str | None]:
    """Decodes a downloaded body into an RGB image, or says why it is not a usable image.

    Args:
        body: the bytes the server sent.
        max_pixels: images with more pixels than this are refused before decoding (decompression bombs).
        draft_size: if given, JPEG data may be decoded at a reduced scale whose sides stay >= this.

    Returns:
        ``(image, None)`` with the image in RGB, orientation applied and the original size kept in
        ``image.info["original_size"]``; or ``(None, reason)`` with reason one of ``empty_body``,
        ``not_an_image``, ``decompression_bomb``, ``truncated``, ``corrupt``.
    """
    if not body:
        return None, "empty_body"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(body))
            original_size = image.size
            if original_size[0] * original_size[1] > max_pixels:
                return None, "decompression_bomb"
            if draft_size is not None and image.format == "JPEG":
                image.draft("RGB", (draft_size, draft_size))
            image.load()
            image = _to_rgb(ImageOps.exif_transpose(image))
    except UnidentifiedImageError:
        return None, "not_an_image" if _looks_like_text(body) else "corrupt"
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return None, "decompression_bomb"
    except (OSError, SyntaxError, ValueError) as error:
        return None, "truncated" if "truncated" in str(error).lower() else "corrupt"
    image.info["original_size"] = original_size
    return image, None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _looks_like_text(body: bytes) -> bool:
    head = body[:512].lstrip().lower()
    return head.startswith(b"<") or all(32 <= byte < 127 or byte in b"\r\n\t" for byte in head)


def center_crop_resize(image: Image.Image, size: int) -> Image.Image:
    """A ``size`` x ``size`` image: the shorter side scaled to ``size``, then the centre cut out."""
    width, height = image.size
    scale = size / min(width, height)
    resized = image.resize((max(size, round(width * scale)), max(size, round(height * scale))), Image.BICUBIC)
    left = (resized.width - size) // 2
    top = (resized.height - size) // 2
    return resized.crop((left, top, left + size, top + size))
