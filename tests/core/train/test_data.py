"""Shard-backed training data: measured size, disjoint per-worker blocks, decoding, and the data set's fingerprint."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vip_core.data.shards import ShardWriter, encode_image, iter_samples, list_shards, sample_image
from vip_core.train.data import (
    ShardPartition,
    check_shard,
    decode_image,
    decode_usable,
    microbatches,
    partition_range,
    measure_shards,
)

IMG = 16


def _image(seed: int, size: tuple[int, int] = (IMG, IMG)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def shard_folder(tmp_path_factory):
    """11 png images (one 20x12, to be resized) in shards of 4, 4 and 3."""
    folder = tmp_path_factory.mktemp("shards")
    with ShardWriter(folder, prefix="img", samples_per_shard=4) as writer:
        for i in range(11):
            size = (20, 12) if i == 5 else (IMG, IMG)
            writer.write(f"{i:05d}", {"png": encode_image(_image(i, size), "png"), "json": {"index": i}})
    return folder


def test_dataset_size_is_counted_from_the_shards(shard_folder):
    shards, counts, _ = measure_shards(shard_folder)
    assert [p.name for p in shards] == ["img-000000.tar", "img-000001.tar", "img-000002.tar"]
    assert counts == [4, 4, 3]


def test_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no shards"):
        measure_shards(tmp_path)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_worker_blocks_are_disjoint_and_cover_every_sample_once(shard_folder, world_size):
    shards, counts, _ = measure_shards(shard_folder)
    owned = []
    for rank in range(world_size):
        part = ShardPartition(shards, counts, rank, world_size, IMG)
        owned.extend(part.global_indices(torch.arange(len(part))).tolist())
    assert sorted(owned) == list(range(11))


def test_a_worker_reads_only_the_shards_of_its_block(shard_folder):
    shards, counts, _ = measure_shards(shard_folder)
    first = ShardPartition(shards, counts, 0, 3, IMG)  # global 0..2: shard 0 only
    last = ShardPartition(shards, counts, 2, 3, IMG)  # global 7..10: shards 1 and 2
    assert [p.name for p in first.shard_files] == ["img-000000.tar"]
    assert [p.name for p in last.shard_files] == ["img-000001.tar", "img-000002.tar"]


def test_images_are_the_shards_images_decoded_in_global_order(shard_folder):
    shards, counts, _ = measure_shards(shard_folder)
    samples = list(iter_samples(list_shards(shard_folder)))
    part = ShardPartition(shards, counts, 1, 2, IMG)  # global 5..10
    local = torch.tensor([0, 3, 1])
    images = part.images(local)
    assert images.shape == (3, 3, IMG, IMG)
    for row, global_index in zip(images, part.global_indices(local).tolist()):
        expected = decode_image(encode_image(sample_image(samples[global_index]), "png"), IMG)
        assert torch.equal(row, expected)
        assert samples[global_index]["json"]["index"] == global_index


def test_decoding_resizes_to_the_model_size_and_normalises():
    x = decode_image(encode_image(_image(0, (40, 24)), "png"), 32)
    assert x.shape == (3, 32, 32)
    white = decode_image(encode_image(Image.new("RGB", (8, 8), (255, 255, 255)), "png"), 8)
    assert torch.allclose(white[:, 0, 0], torch.tensor([2.2489, 2.4286, 2.6400]), atol=1e-3)


def test_an_empty_sample_gives_an_empty_batch(shard_folder):
    shards, counts, _ = measure_shards(shard_folder)
    assert ShardPartition(shards, counts, 0, 1, IMG).images(torch.empty(0, dtype=torch.long)).shape == (0, 3, IMG, IMG)


def test_more_workers_than_samples_is_refused():
    with pytest.raises(ValueError, match="cannot be shared among 4 workers"):
        partition_range(3, 0, 4)


def test_the_fingerprint_tells_apart_data_sets_of_the_same_size_and_shard_names(shard_folder, tmp_path):
    other = tmp_path / "other"
    with ShardWriter(other, prefix="img", samples_per_shard=4) as writer:  # same names and counts, other images
        for i in range(11):
            writer.write(f"{i:05d}", {"png": encode_image(_image(100 + i, (IMG + 1, IMG)), "png"), "json": {"index": i}})
    first, second = measure_shards(shard_folder), measure_shards(other)
    assert [p.name for p in first.shards] == [p.name for p in second.shards] and first.counts == second.counts
    assert first.fingerprint == measure_shards(shard_folder).fingerprint
    assert first.fingerprint != second.fingerprint


def test_microbatches_split_a_logical_batch_in_order():
    chunks = list(microbatches(torch.arange(10), 4))
    assert [c.tolist() for c in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_parquet_shards_are_read_like_tars_and_null_images_skipped(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    payloads = [encode_image(_image(i), "png") for i in range(7)]
    payloads[2] = None  # a failed download, as img2dataset leaves it
    table = pa.table({"key": [f"{i:05d}" for i in range(7)], "jpg": pa.array(payloads, type=pa.binary())})
    pq.write_table(table, tmp_path / "part-00000.parquet", row_group_size=3)
    pq.write_table(table.slice(0, 2), tmp_path / "part-00001.parquet")
    shards, counts, _ = measure_shards(tmp_path)
    assert counts == [6, 2]
    expected = [p for p in payloads if p is not None] + payloads[:2]
    for rank in range(2):
        part = ShardPartition(shards, counts, rank, 2, IMG)
        local = torch.arange(len(part))
        for row, global_index in zip(part.images(local), part.global_indices(local).tolist()):
            assert torch.equal(row, decode_image(expected[global_index], IMG))


def test_parquet_without_an_image_column_is_a_clear_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"url": ["http://127.0.0.1/a.jpg"]}), tmp_path / "urls.parquet")
    with pytest.raises(ValueError, match="has no image column"):
        measure_shards(tmp_path)


def test_a_damaged_image_decodes_as_zeros_marked_not_usable(damaged_shards):
    folder, damaged = damaged_shards
    shards, counts, _ = measure_shards(folder)
    decoded = ShardPartition(shards, counts, 0, 1, IMG).decode(torch.arange(64))
    damaged_positions = sorted(int(name.split(".")[0]) for name in damaged)
    assert torch.nonzero(~decoded.usable).flatten().tolist() == damaged_positions
    assert decoded.pixels[damaged_positions].eq(0).all()
    assert decoded.pixels[decoded.usable].flatten(1).amax(dim=1).gt(0).all()


def test_bytes_a_format_plugin_cannot_handle_are_a_damaged_image_not_a_failed_stage():
    """A DDS header with pixel format 0 makes PIL raise NotImplementedError: the
    author of the data chooses the bytes, and a failed stage would tell that the image was sampled."""
    header = bytearray(128)
    header[0:4] = b"DDS "
    struct.pack_into("<7I", header, 4, 124, 0x1007, 16, 16, 0, 0, 0)  # size, flags, height, width, pitch, depth, mips
    struct.pack_into("<2I", header, 76, 32, 0)  # pixel format: 32 bytes, no FourCC, no RGB
    decoded = decode_usable([bytes(header) + bytes(16 * 16 * 4), encode_image(_image(0))], IMG)
    assert decoded.usable.tolist() == [False, True]


def test_an_image_that_makes_pil_warn_decodes_without_a_word_in_the_log():
    """A palette PNG with byte transparency makes PIL warn; printed only when the image is sampled, the warning would
    tell the worker's log that it was. In a fresh process, as a worker decodes."""
    code = (
        "import io\nfrom PIL import Image\nfrom vip_core.train.data import decode_pixels\n"
        "image = Image.new('P', (40, 40)); image.putpalette([i % 256 for i in range(768)])\n"
        "buffer = io.BytesIO(); image.save(buffer, 'PNG', transparency=bytes(range(256)))\n"
        "print(tuple(decode_pixels(buffer.getvalue(), 16).shape))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[3])
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "(3, 16, 16)", "")


def test_the_check_names_every_damaged_member_of_a_shard(damaged_shards):
    folder, damaged = damaged_shards
    reports = [check_shard(shard, IMG) for shard in list_shards(folder)]
    assert [report["images"] for report in reports] == [32, 32]
    found = {item["member"]: Path(report["shard"]).name for report in reports for item in report["damaged"]}
    assert found == damaged
    assert all(item["error"].split(":")[0] in ("OSError", "UnidentifiedImageError")
               for report in reports for item in report["damaged"])


def test_a_shard_cut_short_is_an_error_naming_it(damaged_shards, tmp_path):
    folder, _ = damaged_shards
    whole = (folder / "web-000000.tar").read_bytes()
    (tmp_path / "web-000000.tar").write_bytes(whole[: len(whole) // 2 + 100])
    with pytest.raises(ValueError, match=r"shard .*web-000000\.tar is not a readable tar"):
        measure_shards(tmp_path)
    assert "error" in check_shard(tmp_path / "web-000000.tar", IMG)
