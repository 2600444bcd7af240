"""``vip pretrain``: bad input is one line and exit code 2, and a run in progress is not overwritten."""

from __future__ import annotations

import contextlib
import io

import pytest

from tasks.cli import main


@pytest.fixture(scope="module")
def shards(noise_shards):
    return noise_shards(96)


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


