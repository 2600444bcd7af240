"""The work around ``vip_core``: file I/O and the frameworks (img2dataset, Ray, MLflow), in rooms that say
what they hold.

- ``tasks/stages/``: one module per pipeline stage; a stage takes a config and paths, does the work,
  resumes what it had written and returns a small serialisable result.
- ``tasks/cli/``: the ``vip`` command, argument parsing only; each sub-command calls one stage or benchmark.
- ``tasks/runtime/``: what every stage shares: the environment, stage folders, MLflow tracking, the Ray session.
- ``tasks/benchmarks/``: the measurements behind ``vip bench``.
- ``tasks/fixtures/``: offline data for demos and tests (the sample web, the small evaluation sets).
"""
