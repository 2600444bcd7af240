"""The generated reference pages: committed as generated, and listing every command, option and config field."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tasks.cli import build_parser
from tasks.cli.reference import REGENERATE, _commands, _collect_sections, cli_page, config_page, main
from vip_core.config import PRESETS, VipConfig

REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "reference"


def section(page: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## ``."""
    start = page.index(f"\n## {heading}\n")
    end = page.find("\n## ", start + 1)
    return page[start:end if end > 0 else None]


def test_the_committed_reference_pages_are_the_generated_ones():
    for name, generated in (("cli.md", cli_page()), ("config.md", config_page())):
        committed = (REFERENCE / name).read_text(encoding="utf-8")
        assert committed == generated, f"docs/reference/{name} is out of date: run `{REGENERATE}`"


def test_every_command_lists_every_option_of_its_parser():
    page = cli_page()
    commands = list(_commands(build_parser(), "vip"))
    assert {prog for prog, _, _ in commands} >= {"vip pretrain", "vip bench dp-step", "vip privacy epsilon"}
    for prog, _, parser in commands:
        text = section(page, f"`{prog}`")
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in text, f"{prog}: {flag} missing from docs/reference/cli.md"


def test_every_config_field_is_listed_with_its_type_and_default_in_its_section():
    page = config_page()
    sections: dict[type, list[str]] = {}
    _collect_sections(VipConfig, "", sections)
    for model in sections:
        text = section(page, model.__name__)
        for name, field in model.model_fields.items():
            row = re.search(rf"^\| `{name}` \|(.*)\|$", text, re.MULTILINE)
            assert row, f"{model.__name__}.{name} missing from docs/reference/config.md"
            if field.description:
                assert " ".join(field.description.split()) in row.group(1).replace("\\|", "|")
    privacy = section(page, "PrivacyConfig")
    assert re.search(r"^\| `target_epsilon` \| float \| `8.0` \| `> 0` \| budget", privacy, re.MULTILINE)
    assert "`private`" in section(page, "TrainingConfig") and "`synthetic`" in section(page, "TrainingConfig")
    assert all(f"| `{name}` |" in section(page, "Presets") for name in PRESETS)


def test_the_help_reads_as_vip_help_prints_it():
    parser = argparse.ArgumentParser(prog="vip")
    commands = parser.add_subparsers(dest="command")
    demo = commands.add_parser("demo", help="a demo")
    demo.add_argument("--rate", type=float, default=0.5, help="share of images (default: %(default)s, 50%%)")
    demo.add_argument("--mode", choices=("a", "b"), required=True, help="one | the other")
    page = cli_page(parser)
    assert "| `--rate` | `RATE` | `0.5` | share of images (default: 0.5, 50%) |" in page
    assert "| `--mode` (required) | `a` \\| `b` |  | one \\| the other |" in page


def test_the_module_writes_both_pages(tmp_path, capsys):
    assert main([str(tmp_path / "reference")]) == 0
    assert (tmp_path / "reference" / "cli.md").read_text() == cli_page()
    assert (tmp_path / "reference" / "config.md").read_text() == config_page()
