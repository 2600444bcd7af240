"""``vip config show`` prints the whole resolved config as YAML that reads back as exactly that config, and every
command that builds a config takes a ``--config`` file and ``--set`` settings, a wrong field being one line."""

from __future__ import annotations

import argparse

import pytest
import yaml

from tasks.cli import build_parser
from vip_core.config import get_preset, resolve_config, validate_config, with_overrides

CONFIG_COMMANDS = [("render",), ("ingest",), ("eval",), ("eval-data",), ("pretrain",), ("audit",), ("shards",),
                   ("config", "show")]


@pytest.mark.parametrize("preset", ["tiny", "vip-base-paper"])
def test_config_show_prints_yaml_that_loads_back_as_exactly_the_preset(preset, vip_here):
    code, out, _ = vip_here("config", "show", "--preset", preset)
    assert code == 0
    assert validate_config(yaml.safe_load(out)) == get_preset(preset)


def test_a_shown_config_edited_and_passed_back_is_the_edited_config(tmp_path, vip_here):
    _, out, _ = vip_here("config", "show", "--preset", "tiny")
    path = tmp_path / "my.yaml"
    path.write_text(out.replace("target_epsilon: 8.0", "target_epsilon: 4", 1))
    code, again, _ = vip_here("config", "show", "--config", str(path), "--set", "private.steps=12")
    assert code == 0
    expected = with_overrides(get_preset("tiny"), {"privacy.target_epsilon": 4.0, "private.steps": 12})
    assert validate_config(yaml.safe_load(again)) == expected


@pytest.mark.parametrize(("argv", "message"), [
    (["--set", "privacy.target_epsilonn=4"],
     "vip config: error: unknown config field privacy.target_epsilonn (did you mean privacy.target_epsilon?)"),
    (["--set", "privacy.target_epsilon=0"], "vip config: error: privacy.target_epsilon: Input should be greater than 0"),
    (["--set", "privacy.target_epsilon"], "vip config: error: malformed setting 'privacy.target_epsilon': expected "
                                          "FIELD=VALUE, such as privacy.target_epsilon=4"),
    (["--config", "/nonexistent/my.yaml"],
     "vip config: error: config file /nonexistent/my.yaml: cannot be read (No such file or directory)"),
])
def test_a_wrong_field_value_setting_or_file_is_one_line_and_exit_code_2(argv, message, vip_here):
    code, out, err = vip_here("config", "show", *argv)
    assert code == 2 and out == ""
    assert err == message + "\n"


def test_vip_pretrain_refuses_a_wrong_field_in_one_line_before_training(tmp_path, vip_here):
    code, _, err = vip_here("pretrain", "--stage", "private", "--data", str(tmp_path), "--output",
                            str(tmp_path / "out"), "--set", "privacy.target_epsilonn=4")
    assert code == 2 and not (tmp_path / "out").exists()
    assert err == ("vip pretrain: error: unknown config field privacy.target_epsilonn "
                   "(did you mean privacy.target_epsilon?)\n")


@pytest.mark.parametrize("command", CONFIG_COMMANDS, ids=" ".join)
def test_every_command_that_builds_a_config_takes_a_file_and_settings(command):
    parser = build_parser()
    for name in command:
        parser = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction)).choices[name]
    flags = {flag for action in parser._actions for flag in action.option_strings}
    assert {"--preset", "--config", "--set"} <= flags


def test_the_flags_of_a_command_sit_between_its_file_and_its_settings(tmp_path):
    from tasks.cli.pretrain import STAGE_FLAGS
    from tasks.cli.options import config_from

    path = tmp_path / "my.toml"
    path.write_text("[private]\nsteps = 30\nbatch_size = 48\ncheckpoint_every = 3\n")
    flags = {flag: (field.format(stage="private"), kind, text) for flag, (field, kind, text) in STAGE_FLAGS.items()}
    args = build_parser().parse_args(["pretrain", "--stage", "private", "--data", "d", "--output", "o",
                                      "--config", str(path), "--steps", "20", "--batch-size", "40",
                                      "--set", "private.batch_size=36"])
    config = config_from(args, flags)
    assert (config.private.steps, config.private.batch_size, config.private.checkpoint_every) == (20, 36, 3)
    assert config == resolve_config("tiny", settings=["private.steps=20", "private.batch_size=36",
                                                      "private.checkpoint_every=3"])


def test_a_setting_refines_a_named_dp_finetune_setting():
    from tasks.cli.eval import evaluation_config

    args = build_parser().parse_args(["eval", "--task", "finetune", "--checkpoint", "c", "--data", "d", "--output", "o",
                                      "--dp-finetune", "imagenet", "--no-baseline",
                                      "--set", "evaluation.finetune_privacy.target_epsilon=4"])
    config = evaluation_config(args)
    dp = config.evaluation.finetune_privacy
    assert (dp.enabled, dp.delta, dp.target_epsilon) == (True, 8e-7, 4.0)
    assert config.evaluation.random_init_baseline is False
