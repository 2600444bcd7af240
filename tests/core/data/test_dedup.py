"""Hashes and the Hamming-distance index, on real photographs and on random hashes against brute force."""

from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image

from tasks.fixtures.web import sample_photo
from vip_core.data.dedup import NOT_FOUND, HammingIndex, build_contamination_index, hamming_distance, perceptual_hash


def test_perceptual_hash_survives_resizing_and_separates_different_photographs():
    photo = sample_photo(0)
    resized = photo.resize((photo.width * 3 // 4, photo.height * 3 // 4), Image.BICUBIC)
    assert hamming_distance(perceptual_hash(photo), perceptual_hash(resized)) <= 4
    others = [perceptual_hash(sample_photo(i)) for i in range(1, 10)]
    assert min(hamming_distance(perceptual_hash(photo), other) for other in others) > 12


@pytest.mark.parametrize("max_distance", [0, 3, 6, 20, 64])
def test_index_finds_the_earliest_stored_hash_within_the_distance(max_distance):
    rng = random.Random(max_distance)
    stored = [rng.getrandbits(64) for _ in range(300)]
    stored += [value ^ (1 << rng.randrange(64)) for value in stored[:50]]  # near pairs among the stored
    index = HammingIndex(stored, max_distance)
    queries = [stored[rng.randrange(len(stored))] ^ (1 << rng.randrange(64)) ^ (1 << rng.randrange(64))
               for _ in range(100)]
    queries += [rng.getrandbits(64) for _ in range(100)]
    found = index.earliest(np.array(queries, dtype=np.uint64))
    expected = [next((position for position, value in enumerate(stored)
                      if hamming_distance(query, value) <= max_distance), NOT_FOUND) for query in queries]
    assert found.tolist() == expected
    assert (found != NOT_FOUND).sum() >= 100 if max_distance >= 3 else True


def test_contamination_index_reads_nested_folders_and_refuses_bad_ones(tmp_path):
    (tmp_path / "eval" / "train" / "cat").mkdir(parents=True)
    sample_photo(1).save(tmp_path / "eval" / "train" / "cat" / "one.png")
    sample_photo(2).save(tmp_path / "eval" / "train" / "cat" / "two.JPG", format="JPEG")
    (tmp_path / "eval" / "notes.txt").write_text("not an image")
    index, hashes = build_contamination_index(tmp_path / "eval", max_distance=6)
    assert len(hashes) == 2
    found = index.earliest(np.array([perceptual_hash(sample_photo(1).resize((70, 70)))], dtype=np.uint64))
    assert list(hashes)[found[0]].endswith("one.png")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_contamination_index(tmp_path / "missing", 6)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no readable image"):
        build_contamination_index(tmp_path / "empty", 6)
