"""``make run``, ``make <stage>`` and ``make serve`` read ``CONFIG=`` and ``SET=`` as ``vip`` reads ``--config`` and
``--set``: the command line the Makefile writes gives the flow (or the deployments) the config of the file with the
settings over it, and a wrong field stops the target with one line before anything runs."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from flows.app import run, serve
from tasks.cli.options import config_from
from vip_core.config import config_yaml, get_preset, with_overrides

ROOT = Path(__file__).resolve().parents[3]


def _make_arguments(target: str, program: str, *variables: str) -> list[str]:
    """The arguments ``make TARGET VARIABLES`` passes to ``python -m PROGRAM``, as the shell splits them."""
    commands = subprocess.run(["make", "-n", target, *variables], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    line = next(line for line in commands.splitlines() if f"-m {program}" in line)
    words = shlex.split(line)
    return words[words.index(program) + 1:]


@pytest.fixture
def my_yaml(tmp_path) -> Path:
    """``vip config show --preset tiny > my.yaml`` with ε edited to 4."""
    path = tmp_path / "my.yaml"
    path.write_text(config_yaml(get_preset("tiny")).replace("target_epsilon: 8.0", "target_epsilon: 4", 1))
    return path


@pytest.mark.parametrize("target", ["run", "pretrain-dp"])
def test_make_with_config_and_set_gives_the_flow_the_file_with_the_settings_over_it(target, my_yaml):
    argv = _make_arguments(target, "flows.app.run", f"CONFIG={my_yaml}",
                           "SET=private.steps=12 evaluation.tasks=[linprobe,coco]")
    config = run.target_config(run.build_parser().parse_args(argv))
    assert config == with_overrides(get_preset("tiny"), {"privacy.target_epsilon": 4.0, "private.steps": 12,
                                                         "evaluation.tasks": ("linprobe", "coco")})


def test_a_wrong_field_stops_make_run_with_one_line(capsys):
    assert run.main(["run", "--set", "privacy.target_epsilonn=4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("make run: error: unknown config field privacy.target_epsilonn "
                            "(did you mean privacy.target_epsilon?)\n")


def test_make_serve_with_config_makes_deployments_whose_default_config_is_the_files(my_yaml):
    argv = _make_arguments("serve", "flows.app.serve", f"CONFIG={my_yaml}", "SET=name=mine")
    config = config_from(serve.build_parser().parse_args(argv))
    made = serve.deployments(config, {"url_list": "urls.parquet", "eval_data": "eval"})
    pipeline = [deployment for deployment in made if deployment.flow_name != "vip-reproduce"]
    assert {deployment.name for deployment in pipeline} == {"mine"}
    expected = with_overrides(get_preset("tiny"), {"privacy.target_epsilon": 4.0, "name": "mine"})
    assert all(deployment.parameters["config"] == expected.model_dump(mode="json") for deployment in pipeline)


def test_a_wrong_field_stops_make_serve_with_one_line_before_it_looks_for_a_server(capsys):
    assert serve.main(["--set", "privacy.target_epsilonn=4"]) == 2
    assert capsys.readouterr().err == ("make serve: error: unknown config field privacy.target_epsilonn "
                                       "(did you mean privacy.target_epsilon?)\n")
