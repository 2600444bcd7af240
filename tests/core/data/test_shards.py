"""Shards: atomic, resumable writing and faithful reading."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vip_core.data.shards import ShardWriter, count_samples, encode_image, iter_samples, list_shards, sample_image


def _image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, size=(8, 8, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_samples_round_trip_across_shards(tmp_path):
    with ShardWriter(tmp_path, prefix="syn", samples_per_shard=3) as writer:
        for i in range(7):
            writer.write(f"{i:04d}", {"png": encode_image(_image(i), "png"), "json": {"index": i}})
    shards = list_shards(tmp_path, "syn")
    assert [p.name for p in shards] == ["syn-000000.tar", "syn-000001.tar", "syn-000002.tar"]
    samples = list(iter_samples(shards))
    assert [s["json"]["index"] for s in samples] == list(range(7))
    assert np.array_equal(np.asarray(sample_image(samples[4])), np.asarray(_image(4)))
    assert count_samples(shards) == 7


def test_killed_writer_leaves_no_partial_shard_and_resume_continues(tmp_path):
    writer = ShardWriter(tmp_path, samples_per_shard=2)
    for i in range(3):
        writer.write(f"{i:04d}", {"jpg": encode_image(_image(i)), "json": {"index": i}})
    # The writer "dies" here: shard 0 is complete, shard 1 is half written and never closed.
    assert [p.name for p in list_shards(tmp_path)] == ["shard-000000.tar"]
    resumed = ShardWriter(tmp_path, samples_per_shard=2)
    assert not list(tmp_path.glob("*.partial"))
    resumed.write("0002", {"jpg": encode_image(_image(2)), "json": {"index": 2}})
    resumed.close()
    keys = [s["__key__"] for s in iter_samples(list_shards(tmp_path))]
    assert keys == ["0000", "0001", "0002"]


def test_bad_key_and_missing_folder_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="must not contain"):
        ShardWriter(tmp_path).write("a.b", {"json": {}})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_shards(tmp_path / "missing")
