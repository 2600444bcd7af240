"""Test-wide set-up: every test session keeps its state in a fresh VIP_HOME, telemetry off, and every test
its privacy ledgers in a folder of its own; moto's S3 server for the tests of data in a bucket."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

os.environ["VIP_HOME"] = tempfile.mkdtemp(prefix="vip-test-home-")
# Each session's home holds servers' databases and stores (up to tens of MB); left behind, they fill the disk.
atexit.register(shutil.rmtree, os.environ["VIP_HOME"], ignore_errors=True)

from tasks.runtime.environment import configure_environment  # noqa: E402

configure_environment()


import pytest  # noqa: E402


@contextlib.contextmanager
def own_ledgers(tmp_path_factory) -> Iterator[Path]:
    """Charges private data sets to ledgers in a fresh folder while the context lasts."""
    folder = tmp_path_factory.mktemp("ledgers")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VIP_LEDGER_DIR", str(folder))
        yield folder


@pytest.fixture(autouse=True, scope="module")
def module_privacy_ledgers(tmp_path_factory):
    """The module-scoped fixtures of a test module charge ledgers of the module's own."""
    with own_ledgers(tmp_path_factory) as folder:
        yield folder


@pytest.fixture(autouse=True)
def own_privacy_ledgers(tmp_path_factory, module_privacy_ledgers):
    """Each test charges private data sets to ledgers of its own: runs of other tests on identical fixture
    data would otherwise be composed into its ε (as they would be for a real data set)."""
    with own_ledgers(tmp_path_factory) as folder:
        yield folder


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on 127.0.0.1, with the environment pointing s3fs (and Ray's workers) at it."""
    import s3fs

    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = {key: os.environ.get(key) for key in (*S3_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec reuses a file system made for an earlier module's server
    try:
        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert server.poll() is None and time.monotonic() < deadline, "moto's S3 server did not start"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(30)
        s3fs.S3FileSystem.clear_instance_cache()
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


@pytest.fixture(scope="module")
def s3(s3_server):
    """An s3fs file system on moto's server, to put test data into buckets and rewrite it."""
    import s3fs

    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})


DAMAGES = {  # how a stored image can be damaged: its JPEG bytes to the bytes stored
    "cut": lambda jpeg: jpeg[: len(jpeg) // 2],
    "html": lambda jpeg: b"<html><body>not found</body></html>",
    "noise": lambda jpeg: bytes(range(256)) * 4,
    "empty": lambda jpeg: b"",
}


@pytest.fixture(scope="session")
def damaged_shards(tmp_path_factory):
    """``(folder, damaged)``: 64 JPEG images of noise in two shards of 32, four of them damaged in each way of
    ``DAMAGES``; ``damaged`` maps each damaged member's name (``00005.jpg``) to its shard's name."""
    import numpy as np
    from PIL import Image

    from vip_core.data.shards import ShardWriter, encode_image

    folder = tmp_path_factory.mktemp("damaged-shards")
    where = {5: "cut", 20: "html", 40: "noise", 63: "empty"}
    with ShardWriter(folder, prefix="web", samples_per_shard=32) as writer:
        for index in range(64):
            pixels = np.random.default_rng(index).integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
            jpeg = encode_image(Image.fromarray(pixels), "jpg")
            writer.write(f"{index:05d}", {"jpg": DAMAGES[where[index]](jpeg) if index in where else jpeg})
    return folder, {f"{index:05d}.jpg": f"web-{index // 32:06d}.tar" for index in where}


@pytest.fixture(scope="session")
def own_images(tmp_path_factory):
    """A researcher's folder of photographs, nested, with every case ``vip shards`` must handle, its evaluation
    data and what ingesting it must give: ``{"folder", "eval_data", "stats", "kept", "duplicates"}`` (``kept``: the
    paths kept; ``duplicates``: each removed copy's path and the kept path it repeats)."""
    from PIL import Image

    from tasks.fixtures.web import distinct_photo_indices, near_duplicate_bytes, photo_bytes, sample_photo

    root = tmp_path_factory.mktemp("own-images")
    folder, eval_data = root / "photos", root / "eval"
    first, second, third, fourth, fifth, evaluated = distinct_photo_indices(6)
    files = {
        "2023/beach/IMG_0001.jpg": photo_bytes(first),
        "2023/IMG_0002.jpg": photo_bytes(second),
        "2024/family/IMG_0003.jpg": photo_bytes(third),
        "2024/family/party/IMG_0003-small.jpg": near_duplicate_bytes(photo_bytes(third)),
        "2024/backup/IMG_0001.jpg": photo_bytes(first),
        "2024/IMG_0005.jpg": photo_bytes(fifth),
        "2024/zoo/IMG_0006.jpg": photo_bytes(evaluated),
        "broken.jpg": photo_bytes(second)[:900],
        "garbage.jpg": bytes(range(256)) * 4,
        "notes.txt": b"shopping list: film, batteries\n",
        ".DS_Store": b"\x00\x00\x00\x01Bud1",
        ".thumbnails/IMG_0002.jpg": photo_bytes(second),
    }
    for name, body in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(body)
    sample_photo(fourth).save(folder / "2024" / "IMG_0004.png")
    Image.new("RGB", (8, 8), "red").save(folder / "icon.png")
    (folder / "moved-away.jpg").symlink_to(folder / "nowhere.jpg")
    evaluated_copy = sample_photo(evaluated)
    (eval_data / "classification" / "val" / "zoo").mkdir(parents=True)
    evaluated_copy.resize((evaluated_copy.width * 9 // 10, evaluated_copy.height * 9 // 10)).save(
        eval_data / "classification" / "val" / "zoo" / "copy.png")
    stats = {"input": 13, "downloaded": 9,
             "failed": {"corrupt": 1, "not_an_image": 1, "truncated": 1, "unreadable": 1},
             "filtered": {"min_side": 1}, "duplicates": 2, "decontaminated": 1, "kept": 5}
    kept = {"2023/IMG_0002.jpg", "2023/beach/IMG_0001.jpg", "2024/IMG_0004.png", "2024/IMG_0005.jpg",
            "2024/family/IMG_0003.jpg"}
    duplicates = {"2024/backup/IMG_0001.jpg": "2023/beach/IMG_0001.jpg",
                  "2024/family/party/IMG_0003-small.jpg": "2024/family/IMG_0003.jpg"}
    return {"folder": folder, "eval_data": eval_data, "stats": stats, "kept": kept, "duplicates": duplicates}
