"""One flow per make target: the Makefile's stage targets are the stage names of ``tasks/runtime/names.py``,
and each runs the flow of that name through the make driver."""

from __future__ import annotations

import subprocess
from pathlib import Path

from flows.targets import FLOWS
from tasks.runtime.names import STAGES

ROOT = Path(__file__).resolve().parents[2]


def test_every_stage_and_the_pipeline_have_a_flow():
    assert list(FLOWS) == ["run", *STAGES]
    assert {flow.name for flow in FLOWS.values()} == {"vip-pipeline", *(f"vip-{stage}" for stage in STAGES)}


def test_the_makefile_runs_each_stage_target_through_the_driver():
    for target in ("run", *STAGES):
        commands = subprocess.run(["make", "-n", target, "PRESET=tiny"], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout
        assert f"-m flows.app.run {target} --preset tiny" in commands, commands
