"""The shared options of ``vip``: a preset is checked while parsing, config flags override their fields,
and every stage command spells its output folder ``--output`` and its MLflow parent ``--mlflow-parent``. The program
parses and supervises without loading torch, so that it answers a bad argument at once."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.cli import build_parser
from tasks.cli.options import add_config_flags, add_preset, config_from

FLAGS = {"--batch-size": ("private.batch_size", int, "B"), "--num-images": ("data.render.num_images", int, "n")}


def test_an_unknown_preset_is_refused_while_parsing(capsys):
    with pytest.raises(SystemExit) as exit_code:
        build_parser().parse_args(["audit", "--preset", "vip-huge"])
    error = capsys.readouterr().err
    assert exit_code.value.code == 2 and error.count("\n") == 1
    assert "argument --preset: unknown preset 'vip-huge' (known: tiny," in error


def test_config_flags_override_their_fields_and_leave_the_rest():
    parser = argparse.ArgumentParser()
    add_preset(parser)
    add_config_flags(parser, FLAGS)
    config = config_from(parser.parse_args(["--batch-size", "32"]), FLAGS)
    assert config.private.batch_size == 32 and config.data.render.num_images == config_from(
        parser.parse_args([]), FLAGS).data.render.num_images


@pytest.mark.parametrize("command", ["render", "ingest", "eval", "eval-data", "pretrain", "audit"])
def test_stage_commands_share_one_spelling_of_output_and_mlflow_parent(command):
    subparsers = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    flags = {flag for action in subparsers.choices[command]._actions for flag in action.option_strings}
    assert "--output" in flags and "--preset" in flags
    assert not flags & {"--out", "--root", "--mlflow-run", "--mlflow-run-id"}
    if command in ("eval", "pretrain", "audit"):
        assert "--mlflow-parent" in flags


def test_the_supervising_program_loads_no_torch_and_answers_a_bad_argument_at_once(tmp_path):
    # `-X importtime` lists the imports of the supervising process only: the supervised child is started without it.
    command = [sys.executable, "-X", "importtime", "-m", "tasks.cli", "shards", "--input", str(tmp_path)]
    result = subprocess.run(command, cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "vip shards: error: --input needs --output" in result.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "tasks.cli.options" in imported and not imported & {"torch", "timm", "ray"}
