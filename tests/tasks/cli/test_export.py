"""``vip export``: the files a user gets and the JSON it prints; bad input is one line and exit code 2."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.cli import main
from vip_core.config import get_preset
from vip_core.models import build_mae, save_checkpoint
from vip_core.privacy.ledger import PrivacyLedger


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run") / "checkpoint"
    ledger = PrivacyLedger(noise_multiplier=0.9, sample_rate=0.25, delta=1e-4, accountant="pld", steps=4)
    save_checkpoint(folder, model=build_mae(get_preset("tiny").model), config=get_preset("tiny"), step=4,
                    ledger=ledger.summary())
    return folder, ledger


def test_export_writes_the_file_and_its_card_and_prints_them(checkpoint, tmp_path, capsys):
    folder, ledger = checkpoint
    assert main(["export", "--checkpoint", str(folder), "--format", "timm", "--output", str(tmp_path / "vip.pth")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["vip.json", "vip.md", "vip.pth"]
    assert printed["output"] == str(tmp_path / "vip.pth") and printed["card_markdown"] == str(tmp_path / "vip.md")
    assert printed["epsilon"] == pytest.approx(ledger.epsilon)
    assert "fc_norm=False" in printed["timm"]
    assert json.loads((tmp_path / "vip.json").read_text())["privacy"]["sample_rate"] == 0.25


@pytest.mark.parametrize(("case", "message"), [
    ("missing", "vip export: error: checkpoint not found"),
    ("released", "not a vip checkpoint"),
    ("format", "argument --format: invalid choice: 'onnx'"),
    ("exists", "exists: choose another --output"),
])
def test_bad_input_is_one_line_and_exit_code_2(checkpoint, tmp_path, vip_here, case, message):
    folder, _ = checkpoint
    torch.save({"model": {"cls_token": torch.zeros(1, 1, 64)}}, tmp_path / "released.pth")
    (tmp_path / "taken.pth").write_bytes(b"kept")
    source = {"missing": tmp_path / "nowhere", "released": tmp_path / "released.pth"}.get(case, folder)
    output = tmp_path / ("taken.pth" if case == "exists" else "out.pth")
    code, _, error = vip_here("export", "--checkpoint", str(source), "--format",
                              "onnx" if case == "format" else "timm", "--output", str(output))
    assert code == 2
    assert error.count("\n") == 1 and message in error
    assert (tmp_path / "taken.pth").read_bytes() == b"kept" and not (tmp_path / "out.pth").exists()
