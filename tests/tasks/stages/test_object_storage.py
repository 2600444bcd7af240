"""Shards in object storage: a real S3-compatible server (moto's server mode) on 127.0.0.1; shards in a bucket
are the data set they are on disk, ingestion writes its clean shards into a bucket and decontaminates against
evaluation images in one, and the evaluation jobs read their data sets from ``s3://``. The private stage's
pre-training from ``s3://`` is tested on two Ray nodes in test_multinode.py."""

from __future__ import annotations

import pytest

from tasks.fixtures.web import (SampleWeb, distinct_photo_indices, laion_row, photo_path, sample_photo,
                                write_url_list)
from tasks.stages.eval import run_evaluation
from tasks.stages.ingest import run_ingest
from tests.tasks.stages.test_ingest import _config as ingest_config
from vip_core.train.data import measure_shards


@pytest.fixture(scope="module")
def bucket_shards(s3, noise_shards):
    """64 images of noise in shards on disk, and uploaded to ``s3://vip-shards/web``."""
    local = noise_shards(64)
    s3.mkdir("vip-shards")
    s3.put(f"{local}/", "vip-shards/web/", recursive=True)
    return local, "s3://vip-shards/web"


def test_shards_in_a_bucket_are_the_same_data_set_as_on_disk(bucket_shards):
    local, url = bucket_shards
    on_disk, in_bucket = measure_shards(local), measure_shards(url)
    assert in_bucket.counts == on_disk.counts and in_bucket.fingerprint == on_disk.fingerprint
    assert all(str(shard).startswith("s3://vip-shards/web/") for shard in in_bucket.shards)


def test_a_missing_bucket_folder_is_a_clear_error(s3_server):
    with pytest.raises(FileNotFoundError, match="s3://vip-shards/nothing"):
        measure_shards("s3://vip-shards/nothing")


def test_ingestion_writes_its_clean_shards_manifest_and_stats_into_a_bucket(s3, tmp_path):
    web = SampleWeb(tmp_path / "web")
    try:
        rows = [laion_row(web.url + photo_path(i), f"photograph {i}") for i in distinct_photo_indices(20)]
        stats = run_ingest(ingest_config(), write_url_list(tmp_path / "laion.parquet", rows), "s3://vip-ingest/web")
    finally:
        web.stop()
    assert stats["output"] == "s3://vip-ingest/web" and stats["kept"] == 20
    assert {"manifest.parquet", "stats.json"} <= {path.rpartition("/")[2] for path in s3.ls("vip-ingest/web")}
    assert sum(measure_shards("s3://vip-ingest/web").counts) == 20


def test_ingestion_decontaminates_against_evaluation_images_in_a_bucket(s3, tmp_path):
    indices = distinct_photo_indices(6)
    photo = sample_photo(indices[0])
    (tmp_path / "eval" / "val" / "a").mkdir(parents=True)
    photo.resize((photo.width * 9 // 10, photo.height * 9 // 10)).save(tmp_path / "eval" / "val" / "a" / "copy.png")
    s3.put(f"{tmp_path / 'eval'}/", "vip-decontaminate/eval/", recursive=True)
    web = SampleWeb(tmp_path / "web")
    try:
        rows = [laion_row(web.url + photo_path(i), f"photograph {i}") for i in indices]
        stats = run_ingest(ingest_config(), write_url_list(tmp_path / "laion.parquet", rows), tmp_path / "out",
                           eval_images="s3://vip-decontaminate/eval")
    finally:
        web.stop()
    assert (stats["decontaminated"], stats["kept"]) == (1, 5)


@pytest.fixture(scope="module")
def bucket_eval_sets(s3, workspace):
    """The evaluation tests' digits (ImageFolder) and ADE20K-layout sets, uploaded below ``s3://vip-eval``."""
    s3.mkdir("vip-eval")
    for name in ("digits", "ade20k"):
        s3.put(f"{workspace[0] / name}/", f"vip-eval/{name}/", recursive=True)
    return "s3://vip-eval"


@pytest.mark.parametrize("task, data", [("fewshot", "digits"), ("ade20k", "ade20k")])
def test_a_job_on_a_set_in_a_bucket_gives_the_numbers_of_the_same_set_on_disk(workspace, bucket_eval_sets, tmp_path,
                                                                            task, data):
    root, config, checkpoint = workspace
    on_disk = run_evaluation(config, task, str(checkpoint), str(root / data), str(tmp_path / "disk"))
    in_bucket = run_evaluation(config, task, str(checkpoint), f"{bucket_eval_sets}/{data}", str(tmp_path / "bucket"))
    assert (in_bucket["result"], in_bucket["baseline"]) == (on_disk["result"], on_disk["baseline"])
    assert in_bucket["data"] == f"s3://vip-eval/{data}"


def test_a_set_rewritten_in_the_bucket_is_other_data_for_the_job(workspace, bucket_eval_sets, s3, tmp_path):
    root, config, checkpoint = workspace
    url, output = f"{bucket_eval_sets}/digits-rewritten", str(tmp_path / "out")
    s3.put(f"{root / 'digits'}/", "vip-eval/digits-rewritten/", recursive=True)
    first = run_evaluation(config, "fewshot", str(checkpoint), url, output)
    assert run_evaluation(config, "fewshot", str(checkpoint), url, output) == first, "stored metrics are reused"
    victim, other = (sorted((root / "digits" / "train" / label).iterdir())[0] for label in ("0", "1"))
    s3.pipe(f"vip-eval/digits-rewritten/train/0/{victim.name}", other.read_bytes())
    with pytest.raises(ValueError, match="holds eval/fewshot work made with data="):
        run_evaluation(config, "fewshot", str(checkpoint), url, output)


def test_a_missing_prefix_or_a_set_of_another_layout_is_a_clear_error(workspace, bucket_eval_sets, tmp_path):
    _, config, checkpoint = workspace
    for url in ("s3://vip-eval/nothing", "s3://no-such-bucket/digits"):
        with pytest.raises(FileNotFoundError, match=f"^folder not found: {url}$"):
            run_evaluation(config, "fewshot", str(checkpoint), url, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"^training split \(train/\) not found: s3://vip-eval/ade20k/train$"):
        run_evaluation(config, "linprobe", str(checkpoint), "s3://vip-eval/ade20k", str(tmp_path / "layout"))
    assert not (tmp_path / "missing").exists() and not (tmp_path / "layout").exists()
