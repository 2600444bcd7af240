"""Checking a folder of shards before a long run: every image decoded as training decodes it.

Training skips an image that does not decode (it contributes nothing: :mod:`vip_core.train.data`), so a
damaged image never stops a run; this check says beforehand which ones there are, and whether every shard can be
read at all (an unreadable shard stops a run at its start). The shards are checked one task each, in this
process or on Ray (:mod:`tasks.runtime.runner`).
"""

from __future__ import annotations

from typing import Any

from tasks.runtime.environment import configure_environment
from tasks.runtime.runner import task_runner
from vip_core.data import storage
from vip_core.train.data import check_shard


def check_shards(data: str, img_size: int, distributor: str) -> dict[str, Any]:
    """Decodes every image of the shards in ``data`` (a folder or fsspec URL of ``*.tar``, else ``*.parquet``).

    Returns:
        ``{"data", "shards", "images", "damaged": [{"shard", "member", "error"}], "unreadable": [{"shard",
        "error"}], "ok"}``: ``ok`` when nothing is damaged or unreadable.

    Raises:
        FileNotFoundError: no shard in ``data``.
    """
    configure_environment()
    shards = storage.glob(data, "*.tar") or storage.glob(data, "*.parquet")
    if not shards:
        raise FileNotFoundError(f"no shards (*.tar or *.parquet) in {data}")
    with task_runner(distributor) as runner:
        reports = runner.get([runner.submit(check_shard, str(shard), img_size) for shard in shards])
    damaged = [{"shard": report["shard"], **item} for report in reports for item in report.get("damaged", [])]
    unreadable = [report for report in reports if "error" in report]
    return {
        "data": str(data), "shards": len(shards), "images": sum(report.get("images", 0) for report in reports),
        "damaged": damaged, "unreadable": unreadable, "ok": not damaged and not unreadable,
    }
