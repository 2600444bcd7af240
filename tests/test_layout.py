"""The layout rule: vip_core is a plain library that imports no orchestration framework."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"prefect", "ray", "mlflow", "img2dataset"}


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_vip_core_sources_import_no_orchestration_package():
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imported_top_levels(path) & FORBIDDEN)
        for path in (ROOT / "vip_core").rglob("*.py")
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"vip_core imports orchestration packages: {offenders}"


def test_importing_all_of_vip_core_loads_no_orchestration_package():
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in (ROOT / "vip_core").rglob("*.py")
    )
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_top_level_layout_exists():
    for name in ("flows", "tasks", "vip_core", "infra", "tests", "pyproject.toml", "Makefile"):
        assert (ROOT / name).exists(), name
