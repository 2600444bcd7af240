"""Evaluation jobs as Ray Train jobs (a real local Ray, two workers of half a CPU): a 2-worker fine-tuning gives the
1-worker result, and DP fine-tuning on two workers charges its runs once, to the set's one ledger (slow)."""

from __future__ import annotations

import pytest

from tasks.runtime.environment import state_paths
from tasks.stages.eval import run_evaluation
from vip_core.config import tiny, with_overrides
from vip_core.privacy.ledger import LedgerBook

# 10 epochs of 7 global batches of 32 digits learn well above chance (0.1) here: enough to tell the runs apart
FINETUNE = {"evaluation.random_init_baseline": False, "evaluation.finetune_epochs": 10,
            "evaluation.batch_size": 32, "evaluation.finetune_lr": 0.01}
TWO_WORKERS = {"evaluation.num_workers": 2, "evaluation.cpus_per_worker": 0.5}
# The same global batches and the same averaged gradients: only the order of float sums differs, which may move a
# prediction or two of the 60 held-out images after 70 steps.
TOP1_TOLERANCE = 3 / 60


def test_a_two_worker_fine_tuning_gives_the_one_worker_result(workspace):
    root, _, checkpoint = workspace
    config = with_overrides(tiny(), FINETUNE)
    one = run_evaluation(config, "finetune", str(checkpoint), str(root / "digits"), str(root / "ray" / "one"))
    two = run_evaluation(with_overrides(config, TWO_WORKERS), "finetune", str(checkpoint), str(root / "digits"),
                         str(root / "ray" / "two"))
    assert (one["device"], two["device"]) == ("cpu", "2 workers, cpu")
    assert one["baseline"] is None and two["baseline"] is None
    assert one["result"]["top1"] >= 2 * one["result"]["chance_top1"], one["result"]
    assert abs(two["result"]["top1"] - one["result"]["top1"]) <= TOP1_TOLERANCE, (one["result"], two["result"])
    assert abs(two["result"]["top5"] - one["result"]["top5"]) <= TOP1_TOLERANCE


@pytest.mark.slow
def test_dp_fine_tuning_on_two_workers_charges_each_run_once_to_the_sets_one_ledger(workspace):
    root, _, checkpoint = workspace
    config = with_overrides(tiny(), {
        **TWO_WORKERS, "evaluation.finetune_privacy.enabled": True, "evaluation.finetune_privacy.batch_size": 32,
        "evaluation.finetune_privacy.physical_batch_size": 16, "evaluation.finetune_privacy.steps": 3,
        "evaluation.finetune_privacy.noise_multiplier": 1.0})
    metrics = run_evaluation(config, "finetune", str(checkpoint), str(root / "digits"), str(root / "ray" / "dp"))
    (ledger,) = state_paths()["ledgers"].glob("*.json")
    book = LedgerBook(ledger, metrics["privacy"]["fingerprint"])
    runs = [run for _, run in metrics["privacy"]["runs"]]
    assert [(charge.run, charge.steps) for charge in book.charges()] == [(run, 3) for run in runs]
    result, baseline = metrics["result"], metrics["baseline"]
    assert result["dp_epsilon"] == baseline["dp_epsilon"] == baseline["dp_epsilon_after_this_run"]
    assert result["dp_epsilon_after_this_run"] < result["dp_epsilon"] <= 8.0
    assert metrics["device"] == "2 workers, cpu"
