"""Runs ``img2dataset.download(**json.loads(ARGS))`` in this process: ``python -m tasks.stages.img2dataset_runner ARGS``.

:mod:`tasks.stages.ingest` starts it as a child process. img2dataset's pool workers and logger are spawned
processes that execute this module again (as ``__mp_main__``), so the module-level lines below hold for
all of them: no update check on import, and the optional packages img2dataset imports but does not use
here are kept out (torch, for webdataset's loader; ray, unless it is the distributor; wandb, with logging
off). On a loaded two-core machine that cuts each process's start from about 35 s to about 10 s. With
img2dataset's Ray distributor the shards are downloaded in Ray tasks on the cluster of ``RAY_ADDRESS``.
"""

from __future__ import annotations

import json
import os
import sys
import types

os.environ["NO_ALBUMENTATIONS_UPDATE"] = "1"
os.environ["WANDB_MODE"] = "disabled"
# spawned processes see the same argv: the arguments, a JSON object
_DISTRIBUTOR = json.loads(sys.argv[1]).get("distributor") if len(sys.argv) > 1 and sys.argv[1].startswith("{") else None
for _unused in ("torch",) if _DISTRIBUTOR == "ray" else ("torch", "ray"):
    sys.modules.setdefault(_unused, None)  # type: ignore[arg-type]
sys.modules.setdefault("wandb", types.ModuleType("wandb"))


def main(argv: list[str]) -> None:
    from img2dataset import download

    download(**json.loads(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
