"""Benchmarks of ``vip bench``: each module defines ``register(bench_subparsers)``."""
