"""The layout rule: imports go one way, ``flows/app → flows → tasks → vip_core``, and each room holds what it says.

- ``vip_core`` is a plain library: it imports no orchestration framework (Prefect, Ray, MLflow, img2dataset)
  and nothing of ``tasks`` or ``flows``.
- Under ``tasks``: ``runtime`` and ``fixtures`` import only the core; ``stages`` the runtime and the core;
  ``benchmarks`` the stages too and the fixtures; ``cli`` (argument parsing only) any of those but no package
  outside the standard library. No module of ``tasks`` imports ``flows`` or Prefect.
- ``flows`` compose the stages: they import the runtime, the core and (inside their tasks) the stages, never
  torch, and never the application above them (``flows/app``), which alone may use the fixtures and the
  command line's options (the make targets read a config as ``vip`` does).
Every ``import`` counts, also the ones inside functions.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORCHESTRATION = {"prefect", "ray", "mlflow", "img2dataset"}
MAY_IMPORT = {
    "vip_core": {"vip_core"},
    "tasks.runtime": {"tasks.runtime", "vip_core"},
    "tasks.fixtures": {"tasks.fixtures", "vip_core"},
    "tasks.stages": {"tasks.stages", "tasks.runtime", "vip_core"},
    "tasks.benchmarks": {"tasks.benchmarks", "tasks.stages", "tasks.runtime", "tasks.fixtures", "vip_core"},
    "tasks.cli": {"tasks.cli", "tasks.benchmarks", "tasks.stages", "tasks.runtime", "tasks.fixtures", "vip_core"},
    "flows": {"flows", "tasks.stages", "tasks.runtime", "vip_core"},
    "flows.app": {"flows.app", "flows", "tasks.runtime", "tasks.fixtures", "tasks.cli", "vip_core"},
}
THIRD_PARTY_BANNED = {
    "vip_core": ORCHESTRATION,
    "tasks": {"prefect"},
    "flows": {"torch", "torchvision", "timm", "opacus"},
}


def room(module: str) -> str | None:
    """The room a first-party module belongs to (``tasks.stages``), or None for a third-party one."""
    if module.split(".")[0] not in ("vip_core", "tasks", "flows"):
        return None
    parts = module.split(".")
    if parts[0] == "vip_core":
        return "vip_core"
    if parts[0] == "flows":
        return "flows.app" if parts[1:2] == ["app"] else "flows"
    return ".".join(parts[:2]) if len(parts) > 1 and parts[1] in ("runtime", "fixtures", "stages", "benchmarks", "cli") \
        else "tasks"


def imports(source: str) -> set[str]:
    """Every module a source imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``), at any depth."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(module: str, source: str) -> list[str]:
    """The imports of ``module`` (its source given) against the direction of the layers or its room's rule."""
    own = room(module)
    found = []
    for name in sorted(imports(source)):
        target = room(name)
        if target is not None and target != "tasks" and target not in MAY_IMPORT.get(own, {own}):
            found.append(f"{module} imports {name} ({own} may not import {target})")
        elif target is None and name.split(".")[0] in _banned(module):
            found.append(f"{module} imports {name}")
        elif target is None and own == "tasks.cli" and not _standard_library(name):
            found.append(f"{module} imports {name} (a command parses arguments; the work is in a stage)")
    return found


def test_no_import_goes_against_the_layers():
    found = [problem for path in _sources() for problem in violations(_module(path), path.read_text())]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("module", "source"), [
    ("tasks.fixtures.web", "from flows.pipeline import vip_pipeline"),
    ("tasks.stages.render", "def f():\n    from tasks.cli import main"),
    ("vip_core.eval.jobs", "import mlflow"),
    ("tasks.cli.render", "import torch"),
    ("flows.graph", "from flows.app.run import run_target"),
    ("flows.stages", "import torch"),
    ("tasks.runtime.tracking", "from tasks.stages.eval import run_evaluation"),
])
def test_an_import_against_the_layers_is_found(module, source):
    assert violations(module, source)


def test_importing_all_of_vip_core_loads_no_orchestration_package():
    modules = sorted(_module(path) for path in (ROOT / "vip_core").rglob("*.py"))
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(ORCHESTRATION)!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_top_level_layout_exists():
    for name in ("flows", "flows/app", "tasks/stages", "tasks/cli", "tasks/runtime", "tasks/fixtures", "vip_core",
                 "infra", "tests", "pyproject.toml", "Makefile"):
        assert (ROOT / name).exists(), name


def _sources() -> list[Path]:
    return sorted(path for top in ("vip_core", "tasks", "flows") for path in (ROOT / top).rglob("*.py"))


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _banned(module: str) -> set[str]:
    top = module.split(".")[0]
    return set() if room(module) == "flows.app" else THIRD_PARTY_BANNED.get(top, set())


def _standard_library(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names or name == "__future__"
