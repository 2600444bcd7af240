"""The pipeline's stage names, defined once: the make targets, the flows' stages, the Prefect cache keys
and the prefixes of the stage folders (``runs/<preset>/<stage>-<digest>``).

The evaluation tasks and their data folders are defined beside the config (``vip_core.config.EVAL_TASKS``,
``EVAL_DATA_FOLDERS``). This module imports nothing but the standard library, so the Makefile reads it
with any Python 3: ``python3 -m tasks.runtime.names`` prints the stage names on one line.
"""

from __future__ import annotations

STAGES = ("ingest", "render", "pretrain-syn", "pretrain-dp", "eval", "audit")
# The two pre-training stages by the ``stage`` argument of the pre-training task and ``vip pretrain``.
PRETRAIN_STAGES = {"synthetic": "pretrain-syn", "private": "pretrain-dp"}
# What a finished evaluation job stores in its folder.
EVAL_METRICS_FILE = "metrics.json"

if __name__ == "__main__":
    print(" ".join(STAGES))
