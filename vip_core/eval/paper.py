"""The ViP paper's ViP-Base figures, by the name of the suite's pair and the metric (fractions, like the jobs').

The results table prints each beside the run's number (``tasks/runtime/results.py``). Only figures the authors
published in text are listed: ImageNet-1k linear probing, 55.7 % top-1 (the paper's abstract, and the authors'
evaluation notes in facebookresearch/ViP-MAE, ``EVAL_LP_FT.md``).
"""

from __future__ import annotations

PAPER_VIP_BASE: dict[str, dict[str, float]] = {
    "linprobe-imagenet": {"top1": 0.557},
}


def paper_figure(pair: str, metric: str) -> float | None:
    """The paper's ViP-Base figure for ``metric`` of ``pair`` (``linprobe-imagenet``, ``top1``), or None."""
    return PAPER_VIP_BASE.get(pair, {}).get(metric)
