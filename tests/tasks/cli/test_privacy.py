"""``vip privacy``: one JSON object on stdout (once through the real entry point), bad arguments exit 2 on one
line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAPER_N = 233_804_767
PAPER = ["--sample-rate", str(98_304 / PAPER_N), "--steps", "6000", "--delta", str(1 / (2 * PAPER_N))]


def _vip(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tasks.cli", *arguments], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def _one_json_object(code: int, out: str, err: str) -> dict:
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    payload = json.loads(lines[0])
    assert isinstance(payload, dict)
    return payload


def test_epsilon_on_the_paper_setting_agrees_with_an_independent_accountant():
    from vip_core.privacy.accounting import compute_epsilon

    result = _vip("privacy", "epsilon", "--noise-multiplier", "0.48", *PAPER)
    payload = _one_json_object(result.returncode, result.stdout, result.stderr)
    assert payload["accountant"] == "pld"
    independent = compute_epsilon(noise_multiplier=0.48, sample_rate=98_304 / PAPER_N, steps=6000,
                                  delta=1 / (2 * PAPER_N), accountant="prv")  # opacus PRV, not dp_accounting PLD
    assert payload["epsilon"] == pytest.approx(independent, rel=0.02)


def test_epsilon_with_rdp_is_the_larger_bound_and_shows_the_tight_pld_one_beside_it(vip_here):
    rdp = _one_json_object(*vip_here("privacy", "epsilon", "--noise-multiplier", "0.48", *PAPER, "--accountant", "rdp"))
    assert rdp == {"epsilon": pytest.approx(7.99, abs=0.01), "accountant": "rdp",
                   "epsilon_pld": pytest.approx(6.83, abs=0.01)}


def test_calibrate_returns_sigma_whose_epsilon_meets_the_target(vip_here):
    payload = _one_json_object(*vip_here("privacy", "calibrate", "--target-epsilon", "2", "--sample-rate", "0.01",
                                         "--steps", "1000", "--delta", "1e-5"))
    assert set(payload) == {"noise_multiplier", "epsilon", "accountant"}
    assert 1.9 < payload["epsilon"] <= 2.0
    assert 0.5 < payload["noise_multiplier"] < 2.0


VALID = {"--noise-multiplier": "1.0", "--sample-rate": "0.01", "--steps": "100", "--delta": "1e-5"}


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--noise-multiplier", None),
        ("--noise-multiplier", "-1"),
        ("--noise-multiplier", "abc"),
        ("--sample-rate", "0"),
        ("--sample-rate", "1.5"),
        ("--delta", "1"),
        ("--delta", "0"),
        ("--steps", "ten"),
    ],
)
def test_bad_argument_exits_2_with_one_line_naming_it(flag, value, vip_here):
    arguments = {**VALID, flag: value}
    argv = [part for name, given in arguments.items() if given is not None for part in (name, given)]
    code, out, err = vip_here("privacy", "epsilon", *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert flag in lines[0]


def test_calibrate_without_target_names_it(vip_here):
    code, _, err = vip_here("privacy", "calibrate", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5")
    assert code == 2 and "--target-epsilon" in err
    assert len(err.strip().splitlines()) == 1
