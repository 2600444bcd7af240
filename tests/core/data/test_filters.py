"""Filters and body checks on real photographs and on the bad bodies web hosts send."""

from __future__ import annotations

import io

import pytest
from pydantic import ValidationError
from PIL import Image

from tasks.fixtures.web import PAGE, _bomb_png, photo_bytes, sample_photo
from vip_core.config import IngestConfig
from vip_core.data.filters import SampleFilter, center_crop_resize, decode_web_image, is_nsfw, parse_condition

LIMIT = 89_478_485


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_conditions_compare_numbers_and_strings_and_fail_on_missing_values():
    similar = parse_condition("similarity >= 0.28")
    assert similar.holds({"similarity": 0.3}) and not similar.holds({"similarity": 0.2})
    assert not similar.holds({"similarity": None}) and not similar.holds({})
    licensed = parse_condition("LICENSE != '?'")
    assert licensed.holds({"LICENSE": "cc-by"}) and not licensed.holds({"LICENSE": "?"})


@pytest.mark.parametrize("text", ["similarity", "similarity >= high", ">= 3", "a ~ 3"])
def test_malformed_conditions_are_refused_by_the_config(text):
    with pytest.raises(ValidationError, match="condition"):
        IngestConfig(conditions=(text,))


def test_sample_filter_reports_the_first_failing_filter():
    sample_filter = SampleFilter.from_texts(["similarity >= 0.28"], min_side=32, max_aspect_ratio=3.0)
    good = {"NSFW": "UNLIKELY", "similarity": 0.3}
    assert sample_filter.reason(good, 64, 48) is None
    assert sample_filter.reason({**good, "NSFW": "NSFW"}, 64, 48) == "nsfw"
    assert sample_filter.reason({**good, "similarity": 0.1}, 64, 48) == "condition: similarity >= 0.28"
    assert sample_filter.reason(good, 31, 48) == "min_side"
    assert sample_filter.reason(good, 400, 100) == "aspect_ratio"
    assert SampleFilter(min_side=1, max_aspect_ratio=3.0, drop_nsfw=False).reason({"NSFW": "NSFW"}, 8, 8) is None


def test_punsafe_above_the_threshold_counts_as_nsfw():
    assert is_nsfw({"punsafe": 0.9}, max_punsafe=0.5)
    assert not is_nsfw({"punsafe": 0.1, "NSFW": "UNSURE"}, max_punsafe=0.5)


def test_a_photograph_decodes_with_its_original_size():
    body = photo_bytes(3)
    image, reason = decode_web_image(body, LIMIT, draft_size=32)
    assert reason is None and image.mode == "RGB"
    assert image.info["original_size"] == sample_photo(3).size
    assert min(image.size) >= 32


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", "empty_body"),
        (PAGE, "not_an_image"),
        (bytes(range(256)) * 8, "corrupt"),
        (photo_bytes(2)[: len(photo_bytes(2)) * 6 // 10], "truncated"),
        (_bomb_png(), "decompression_bomb"),
    ],
    ids=["empty", "html", "random", "truncated", "bomb"],
)
def test_bad_bodies_get_their_reason(body, reason):
    assert decode_web_image(body, LIMIT) == (None, reason)


def test_the_pixel_limit_is_checked_before_decoding():
    body = _png(sample_photo(4))
    width, height = sample_photo(4).size
    assert decode_web_image(body, width * height - 1) == (None, "decompression_bomb")
    assert decode_web_image(body, width * height)[1] is None


def test_transparent_images_are_put_on_white_and_crops_are_square():
    transparent = Image.new("RGBA", (40, 20), (255, 0, 0, 0))
    image, _ = decode_web_image(_png(transparent), LIMIT)
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert center_crop_resize(sample_photo(5), 32).size == (32, 32)
