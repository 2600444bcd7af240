"""``vip bench <name>``: benchmarks that print their figures beside a baseline measured in the same run.

Each benchmark is a module ``tasks/benchmarks/<name>.py`` defining ``register(bench_subparsers)``; add its
module name to :data:`BENCHMARK_MODULES`.
"""

from __future__ import annotations

import importlib
from typing import Any

BENCHMARK_MODULES = (
    "tasks.benchmarks.dp_step",
    "tasks.benchmarks.render",
    "tasks.benchmarks.ingest",
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks with a same-run baseline")
    bench_subparsers = parser.add_subparsers(dest="benchmark", required=True, parser_class=type(parser))
    for module_name in BENCHMARK_MODULES:
        importlib.import_module(module_name).register(bench_subparsers)
