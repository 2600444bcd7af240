"""``vip pretrain``: bad input is one line and exit code 2, and a run in progress is not overwritten."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
from PIL import Image

from tasks.cli import main
from vip_core.data.shards import ShardWriter, encode_image


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    with ShardWriter(folder, prefix="img", samples_per_shard=32) as writer:
        for i in range(96):
            pixels = np.random.default_rng(i).integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
            writer.write(f"{i:05d}", {"png": encode_image(Image.fromarray(pixels), "png")})
    return folder


def _vip(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_bad_input_is_one_line_and_exit_code_2(shards, tmp_path, capsys):
    cases = [
        (["--data", str(tmp_path / "missing")], "does not exist"),
        (["--data", str(shards), "--batch-size", "500"], "exceeds the 96 images"),
    ]
    for extra, message in cases:
        code, _ = _vip("pretrain", "--stage", "synthetic", "--output", str(tmp_path / "o"), *extra)
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    (tmp_path / "busy" / "ray" / "pretrain-syn").mkdir(parents=True)
    code, _ = _vip("pretrain", "--stage", "synthetic", "--data", str(shards), "--output", str(tmp_path / "busy"))
    assert code == 2 and "pass --resume" in capsys.readouterr().err


