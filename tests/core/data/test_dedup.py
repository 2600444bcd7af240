"""Hashes and the near-duplicate index, on real photographs and on random hashes against brute force."""

from __future__ import annotations

import random

import pytest
from PIL import Image

from tasks.fixtures.web import sample_photo
from vip_core.data.dedup import (
    Deduplicator,
    NearDuplicateIndex,
    build_contamination_index,
    content_hash,
    hamming_distance,
    perceptual_hash,
)


def test_perceptual_hash_survives_resizing_and_separates_different_photographs():
    photo = sample_photo(0)
    resized = photo.resize((photo.width * 3 // 4, photo.height * 3 // 4), Image.BICUBIC)
    assert hamming_distance(perceptual_hash(photo), perceptual_hash(resized)) <= 4
    others = [perceptual_hash(sample_photo(i)) for i in range(1, 10)]
    assert min(hamming_distance(perceptual_hash(photo), other) for other in others) > 12


@pytest.mark.parametrize("max_distance", [0, 3, 6, 20])
def test_index_agrees_with_brute_force(max_distance):
    rng = random.Random(max_distance)
    stored = [rng.getrandbits(64) for _ in range(300)]
    index = NearDuplicateIndex(max_distance)
    for position, value in enumerate(stored):
        index.add(value, str(position))
    queries = [stored[rng.randrange(300)] ^ (1 << rng.randrange(64)) ^ (1 << rng.randrange(64)) for _ in range(100)]
    queries += [rng.getrandbits(64) for _ in range(100)]
    for query in queries:
        expected = any(hamming_distance(query, value) <= max_distance for value in stored)
        found = index.find(query)
        assert (found is not None) == expected
        if found is not None:
            assert hamming_distance(query, stored[int(found)]) <= max_distance


def test_deduplicator_keeps_the_first_and_names_it():
    dedup = Deduplicator(phash_max_distance=4)
    dedup.add("a", content_hash(b"one"), 0b1111)
    assert dedup.duplicate_of(content_hash(b"one"), 1 << 63) == ("exact", "a")
    assert dedup.duplicate_of(content_hash(b"two"), 0b0111) == ("perceptual", "a")
    assert dedup.duplicate_of(content_hash(b"two"), (1 << 64) - 1) is None


def test_contamination_index_reads_nested_folders_and_refuses_bad_ones(tmp_path):
    (tmp_path / "eval" / "train" / "cat").mkdir(parents=True)
    sample_photo(1).save(tmp_path / "eval" / "train" / "cat" / "one.png")
    sample_photo(2).save(tmp_path / "eval" / "train" / "cat" / "two.JPG", format="JPEG")
    (tmp_path / "eval" / "notes.txt").write_text("not an image")
    index, hashes = build_contamination_index(tmp_path / "eval", max_distance=6)
    assert len(hashes) == 2
    assert index.find(perceptual_hash(sample_photo(1).resize((70, 70)))) is not None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_contamination_index(tmp_path / "missing", 6)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no readable image"):
        build_contamination_index(tmp_path / "empty", 6)
