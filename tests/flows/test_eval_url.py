"""The evaluation flow (``make eval``) on evaluation data in a bucket (moto's S3 server on 127.0.0.1): the numbers
of the same data on disk, Cached the second time, and a file rewritten in the bucket is other data (another
cache key and folder); a root with no file below it fails the flow, naming it."""

from __future__ import annotations

import pytest
import torch

from flows.app.run import stage_states
from flows.caching import eval_folder, eval_stage, stage_cache_key
from flows.eval import eval_flow
from tasks.fixtures.eval_sets import make_digits_imagefolder
from vip_core.config import tiny, with_overrides
from vip_core.models import build_mae, save_checkpoint

CONFIG = with_overrides(tiny(), {"evaluation.tasks": ("fewshot",)})


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory, s3):
    """``(root, url, checkpoint)``: digits as ``classification/`` below a local root and below ``s3://vip-flow-eval``,
    and an untrained tiny MAE's checkpoint."""
    root = tmp_path_factory.mktemp("eval-data")
    make_digits_imagefolder(root / "classification", img_size=32, per_class=10)
    s3.mkdir("vip-flow-eval")
    s3.put(f"{root}/", "vip-flow-eval/", recursive=True)
    torch.manual_seed(0)
    checkpoint = save_checkpoint(tmp_path_factory.mktemp("run"), model=build_mae(CONFIG.model), config=CONFIG,
                                 stage="private", step=0)
    return root, "s3://vip-flow-eval", str(checkpoint)


def test_the_eval_flow_on_a_bucket_gives_the_numbers_of_the_same_data_on_disk(prefect_api, eval_data, tmp_path):
    root, url, checkpoint = eval_data
    on_disk = eval_flow(config=CONFIG, eval_data=str(root), workdir=str(tmp_path), checkpoint=checkpoint)
    first, again = (eval_flow(config=CONFIG, eval_data=url, workdir=str(tmp_path), checkpoint=checkpoint,
                              return_state=True) for _ in range(2))
    in_bucket = first.result()["fewshot"]
    assert (in_bucket["result"], in_bucket["baseline"]) == (on_disk["fewshot"]["result"], on_disk["fewshot"]["baseline"])
    assert in_bucket["data"] == "s3://vip-flow-eval/classification"
    assert dict(stage_states(first)) == {"eval-fewshot": "Completed"}
    assert dict(stage_states(again)) == {"eval-fewshot": "Cached"} and again.result()["fewshot"] == in_bucket


def test_a_file_rewritten_in_the_bucket_changes_the_jobs_cache_key_and_folder(eval_data, s3, tmp_path):
    root, _, checkpoint = eval_data
    s3.put(f"{root}/", "vip-flow-rewritten/", recursive=True)
    url = "s3://vip-flow-rewritten"

    def key_and_folder():
        parameters = {"config": CONFIG, "task": "fewshot", "name": "fewshot", "checkpoint": checkpoint,
                      "data": f"{url}/classification", "output": "/o", "parent_run_id": None}
        return (stage_cache_key(eval_stage)(None, parameters),
                eval_folder(CONFIG, tmp_path, CONFIG.evaluation.pairs[0], checkpoint, url))

    before = key_and_folder()
    assert key_and_folder() == before
    victim = sorted((root / "classification" / "train" / "0").iterdir())[0]
    s3.pipe(f"vip-flow-rewritten/classification/train/0/{victim.name}", b"other bytes")
    after = key_and_folder()
    assert after[0] != before[0] and after[1] != before[1]


def test_an_evaluation_root_with_no_file_below_it_fails_the_flow_naming_it(prefect_api, eval_data, tmp_path):
    _, _, checkpoint = eval_data
    state = eval_flow(config=CONFIG, eval_data="s3://vip-flow-eval/nothing", workdir=str(tmp_path),
                      checkpoint=checkpoint, return_state=True)
    assert state.is_failed() and "folder not found: s3://vip-flow-eval/nothing" in state.message
    assert stage_states(state) == [] and not list(tmp_path.iterdir())
