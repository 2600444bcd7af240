"""``vip pretrain``: bad input is one line and exit code 2, a run in progress is not overwritten, and a ``--set``
setting reaches the training: the private stage spends the ε it names."""

from __future__ import annotations

import json

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




def test_a_setting_gives_the_private_stage_its_epsilon(shards, tmp_path, vip_here):
    output = tmp_path / "private"
    code, out, _ = vip_here("pretrain", "--stage", "private", "--data", str(shards), "--output", str(output),
                            "--workers", "1", "--cpus-per-worker", "0.5", "--steps", "2", "--batch-size", "32",
                            "--physical-batch-size", "16", "--checkpoint-every", "2",
                            "--set", "privacy.target_epsilon=4")
    assert code == 0
    result = json.loads(out)
    assert 3.8 < result["epsilon"] <= 4.0, result  # σ is calibrated to 0.1 %: ε just below the target
    saved = json.loads((output / "result.json").read_text())["config"]
    assert saved["privacy"]["target_epsilon"] == 4.0 and saved["private"]["steps"] == 2
