"""``vip render``: shards and a contact sheet from the command line; bad input is one line and exit code 2."""

from __future__ import annotations

import json

from PIL import Image

from tasks.cli import main
from tasks.stages.render import write_contact_sheet


def test_vip_render_command_and_contact_sheet(tmp_path, capsys):
    sheet = tmp_path / "sheet.png"
    code = main([
        "render", "--output", str(tmp_path / "cli"), "--num-images", "16", "--size", "32", "--seed", "5",
        "--samples-per-shard", "16", "--contact-sheet", str(sheet),
    ])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["images"] == 16 and result["contact_sheet"] == str(sheet)
    assert Image.open(sheet).size == (8 * 34 + 2, 2 * 34 + 2)
    assert write_contact_sheet(tmp_path / "cli", tmp_path / "four.png", count=4)["images"] == 4


def test_vip_render_bad_input_is_one_line(tmp_path, capsys):
    assert main(["render", "--output", str(tmp_path / "bad"), "--size", "0"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("vip render: error:") and "data.render.size" in error and "\n" not in error
    assert main(["render", "--output", str(tmp_path / "bad"), "--shaders", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
