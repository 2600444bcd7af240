"""``vip pretrain``: bad input is one line and exit code 2, and a run in progress is not overwritten. A run of the
command that spends the ε a ``--set`` setting names is in test_shards.py, on a researcher's own images."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def shards(noise_shards):
    return noise_shards(96)


def test_bad_input_is_one_line_and_exit_code_2(shards, tmp_path, vip_here):
    cases = [
        (["--data", str(tmp_path / "missing")], "does not exist"),
        (["--data", str(shards), "--batch-size", "500"], "exceeds the 96 images"),
    ]
    for extra, message in cases:
        code, _, err = vip_here("pretrain", "--stage", "synthetic", "--output", str(tmp_path / "o"), *extra)
        err = err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    (tmp_path / "busy" / "ray" / "pretrain-syn").mkdir(parents=True)
    code, _, err = vip_here("pretrain", "--stage", "synthetic", "--data", str(shards), "--output",
                            str(tmp_path / "busy"))
    assert code == 2 and "pass --resume" in err
