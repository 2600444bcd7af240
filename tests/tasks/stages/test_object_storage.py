"""Shards in object storage: a real S3-compatible server (moto's server mode) on 127.0.0.1; ingestion writes
its clean shards into a bucket, the private stage pre-trains from ``s3://`` on a real local Ray, and the
evaluation jobs read their data sets from ``s3://``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tasks.fixtures.web import SampleWeb, distinct_photo_indices, laion_row, photo_path, write_url_list
from tasks.runtime.ray_session import ray_session
from tasks.stages.eval import run_evaluation
from tasks.stages.ingest import run_ingest
from tasks.stages.pretrain import run_pretrain
from tests.tasks.stages.test_ingest import _config as ingest_config
from tests.tasks.stages.test_pretrain import IMAGES, _private_config
from vip_core.config import with_overrides
from vip_core.train.data import measure_shards

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on 127.0.0.1, with the environment pointing s3fs (and Ray's workers) at it."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = {key: os.environ.get(key) for key in (*S3_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert server.poll() is None and time.monotonic() < deadline, "moto's S3 server did not start"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(30)
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


@pytest.fixture(scope="module")
def bucket_shards(s3_server, noise_shards):
    """The pre-training tests' shards, uploaded to ``s3://vip-shards/web``."""
    import s3fs

    local = noise_shards(IMAGES)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("vip-shards")
    fs.put(f"{local}/", "vip-shards/web/", recursive=True)
    return local, "s3://vip-shards/web"


def test_shards_in_a_bucket_are_the_same_data_set_as_on_disk(bucket_shards):
    local, url = bucket_shards
    on_disk, in_bucket = measure_shards(local), measure_shards(url)
    assert in_bucket.counts == on_disk.counts and in_bucket.fingerprint == on_disk.fingerprint
    assert all(str(shard).startswith("s3://vip-shards/web/") for shard in in_bucket.shards)


def test_a_missing_bucket_folder_is_a_clear_error(s3_server):
    with pytest.raises(FileNotFoundError, match="s3://vip-shards/nothing"):
        measure_shards("s3://vip-shards/nothing")


def test_the_private_stage_pre_trains_from_s3_shards(bucket_shards, tmp_path):
    _, url = bucket_shards
    config = with_overrides(_private_config(), {"private.steps": 2})
    with ray_session(num_workers=2, cpus_per_worker=0.5):
        result = run_pretrain(config, "private", url, tmp_path / "out")
    assert result["steps"] == 2 and result["dataset_size"] == IMAGES and result["epsilon"] > 0
    assert result["workers"] == 2


def test_ingestion_writes_its_clean_shards_manifest_and_stats_into_a_bucket(s3_server, tmp_path):
    import s3fs

    web = SampleWeb(tmp_path / "web")
    try:
        rows = [laion_row(web.url + photo_path(i), f"photograph {i}") for i in distinct_photo_indices(20)]
        stats = run_ingest(ingest_config(), write_url_list(tmp_path / "laion.parquet", rows), "s3://vip-ingest/web")
    finally:
        web.stop()
    assert stats["output"] == "s3://vip-ingest/web" and stats["kept"] == 20
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    assert {"manifest.parquet", "stats.json"} <= {path.rpartition("/")[2] for path in fs.ls("vip-ingest/web")}
    assert sum(measure_shards("s3://vip-ingest/web").counts) == 20


@pytest.fixture(scope="module")
def bucket_eval_sets(s3_server, workspace):
    """The evaluation tests' digits (ImageFolder) and ADE20K-layout sets, uploaded below ``s3://vip-eval``."""
    fs = _s3(s3_server)
    fs.mkdir("vip-eval")
    for name in ("digits", "ade20k"):
        fs.put(f"{workspace[0] / name}/", f"vip-eval/{name}/", recursive=True)
    return "s3://vip-eval"


def _s3(endpoint: str):
    import s3fs

    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})


@pytest.mark.parametrize("task, data", [("fewshot", "digits"), ("ade20k", "ade20k")])
def test_a_job_on_a_set_in_a_bucket_gives_the_numbers_of_the_same_set_on_disk(workspace, bucket_eval_sets, tmp_path,
                                                                            task, data):
    root, config, checkpoint = workspace
    on_disk = run_evaluation(config, task, str(checkpoint), str(root / data), str(tmp_path / "disk"))
    in_bucket = run_evaluation(config, task, str(checkpoint), f"{bucket_eval_sets}/{data}", str(tmp_path / "bucket"))
    assert (in_bucket["result"], in_bucket["baseline"]) == (on_disk["result"], on_disk["baseline"])
    assert in_bucket["data"] == f"s3://vip-eval/{data}"


def test_a_set_rewritten_in_the_bucket_is_other_data_for_the_job(workspace, bucket_eval_sets, s3_server, tmp_path):
    root, config, checkpoint = workspace
    url, output = f"{bucket_eval_sets}/digits-rewritten", str(tmp_path / "out")
    _s3(s3_server).put(f"{root / 'digits'}/", "vip-eval/digits-rewritten/", recursive=True)
    first = run_evaluation(config, "fewshot", str(checkpoint), url, output)
    assert run_evaluation(config, "fewshot", str(checkpoint), url, output) == first, "stored metrics are reused"
    victim, other = (sorted((root / "digits" / "train" / label).iterdir())[0] for label in ("0", "1"))
    _s3(s3_server).pipe(f"vip-eval/digits-rewritten/train/0/{victim.name}", other.read_bytes())
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
