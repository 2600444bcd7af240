"""The evaluation flow fans out over the suite's (task, data set) pairs: one Prefect task, folder, cache key and
MLflow child run each, a row each in the results; without the random-init baseline each job runs once."""

from __future__ import annotations

import shutil

import pytest
import torch

from flows.app.run import stage_states
from flows.eval import eval_flow
from tasks.fixtures.eval_sets import make_digits_imagefolder
from tasks.runtime import results, tracking
from vip_core.config import tiny, with_overrides
from vip_core.models import build_mae, save_checkpoint

SUITE = [{"task": "fewshot", "data": "classification"}, {"task": "fewshot", "data": "digits-again"}]
CONFIG = with_overrides(tiny(), {"evaluation.suite": SUITE, "evaluation.random_init_baseline": False,
                                 "evaluation.fewshot_seeds": 1})


@pytest.fixture(scope="module")
def eval_root(tmp_path_factory):
    """``(root, checkpoint)``: digits as ``classification/`` and, a second set, ``digits-again/``."""
    root = tmp_path_factory.mktemp("suite")
    make_digits_imagefolder(root / "classification", img_size=32, per_class=10)
    shutil.copytree(root / "classification", root / "digits-again")
    torch.manual_seed(0)
    checkpoint = save_checkpoint(tmp_path_factory.mktemp("run"), model=build_mae(CONFIG.model), config=CONFIG,
                                 stage="private", step=0)
    return root, str(checkpoint)


def test_each_pair_of_the_suite_is_a_task_a_folder_and_a_child_run_of_its_own(prefect_api, eval_root, tmp_path):
    root, checkpoint = eval_root
    state = eval_flow(config=CONFIG, eval_data=str(root), workdir=str(tmp_path), checkpoint=checkpoint,
                      return_state=True)
    evaluations = state.result()
    assert dict(stage_states(state)) == {"eval-fewshot": "Completed", "eval-fewshot-digits-again": "Completed"}
    assert set(evaluations) == {"fewshot", "fewshot-digits-again"}
    assert evaluations["fewshot-digits-again"]["data"] == str(root / "digits-again")
    assert evaluations["fewshot"]["result"] == evaluations["fewshot-digits-again"]["result"]  # the same images
    assert all(metrics["baseline"] is None and set(metrics["seconds"]) == {"result"} for metrics in evaluations.values())
    folders = sorted(path.name.rsplit("-", 1)[0] for path in tmp_path.iterdir())  # eval-<pair>-<digest>
    assert folders == ["eval-fewshot", "eval-fewshot-digits-again"]
    names = sorted(child.info.run_name for child in tracking.child_runs(_parent(state)))
    assert names == ["eval-fewshot", "eval-fewshot-digits-again"]
    rows = [line.split() for line in results.evaluation_table(evaluations)[2:]]
    for name, metrics in evaluations.items():
        assert [row[1] for row in rows if row[0] == name] == list(metrics["result"])
        assert all(row[3] == "-" for row in rows if row[0] == name)  # no baseline


def _parent(state) -> str:
    """The MLflow parent run of a flow run (tagged with its id)."""
    runs = tracking.client().search_runs(
        [tracking.experiment_id()], filter_string=f"tags.`{tracking.FLOW_RUN_TAG}` = '{state.state_details.flow_run_id}'")
    return runs[0].info.run_id
