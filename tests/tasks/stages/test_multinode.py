"""Two Ray nodes on this machine (``two_node_cluster``), each started with the credentials of a real S3-compatible
server on 127.0.0.1 in its environment, as a cluster's nodes hold theirs. The private stage's pre-training joins them
through ``RAY_ADDRESS`` and trains one worker on each from shards in a bucket. The ingestion runs img2dataset's Ray
distributor and the shards' tasks on the cluster, the deduplication in partitions that travel between the nodes, and
a task killed with its process: the same clean shards, manifest and stats as in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.fixtures.web import SampleWeb, distinct_photo_indices, laion_row, photo_path, sample_photo, write_url_list
from tasks.stages.ingest import run_ingest
from tasks.stages.ingest_shards import FAULT_ENV
from tests.tasks.conftest import CLUSTER_ENV
from vip_core.config import get_preset, with_overrides
from vip_core.data.shards import iter_samples, list_shards
from vip_core.models.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[3]
IMAGES = 64


@pytest.fixture(scope="module")
def cluster(s3_server, two_node_cluster):
    """The cluster's address; the S3 server is up, and its credentials in the environment, before the nodes start."""
    return two_node_cluster


@pytest.fixture(scope="module")
def bucket_shards(s3, noise_shards):
    s3.mkdir("vip-nodes")
    s3.put(f"{noise_shards(IMAGES)}/", "vip-nodes/web/", recursive=True)
    return "s3://vip-nodes/web"


def _driver(code: str, *argv: str, cluster: str, **env: str) -> dict:
    """Runs ``code`` in a driver process of its own, as a user's would (a process that already ran and shut down a
    local Ray, as earlier tests in this session do, cannot reliably join another cluster); its printed result."""
    driver = subprocess.run([sys.executable, "-c", code, *argv], env={**os.environ, **CLUSTER_ENV,
                            "RAY_ADDRESS": cluster, **env}, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert driver.returncode == 0, driver.stderr[-3000:]
    return json.loads(driver.stdout.rsplit("RESULT ", 1)[1])


_PRETRAIN = """
import json, sys
from tasks.stages.pretrain import run_pretrain
from vip_core.config import get_preset, with_overrides

config = with_overrides(get_preset("tiny"), json.loads(sys.argv[1]))
result = run_pretrain(config, "private", sys.argv[2], sys.argv[3])
print("RESULT " + json.dumps({key: result[key] for key in ("nodes", "workers", "steps", "checkpoint", "dataset_size",
                                                            "epsilon")}))
"""


def test_private_pretraining_spans_two_nodes_reading_shards_from_a_bucket(cluster, bucket_shards, tmp_path):
    # 0.75 CPU per worker and one CPU per node: the two workers cannot share a node.
    overrides = {
        "private.num_workers": 2, "private.cpus_per_worker": 0.75, "private.steps": 2,
        "private.batch_size": 16, "private.physical_batch_size": 16, "private.checkpoint_every": 2,
    }
    result = _driver(_PRETRAIN, json.dumps(overrides), bucket_shards, str(tmp_path / "out"), cluster=cluster)
    assert result["nodes"] == 2 and result["workers"] == 2
    assert result["steps"] == 2 and result["dataset_size"] == IMAGES and result["epsilon"] > 0
    assert load_checkpoint(result["checkpoint"])["step"] == 2


_INGEST = """
import json, sys
import ray
from tasks.stages.ingest import run_ingest
from vip_core.config import get_preset, with_overrides

ray.init()
nodes = sum(node["Alive"] for node in ray.nodes())
config = with_overrides(get_preset("tiny"), json.loads(sys.argv[1]))
stats = run_ingest(config, sys.argv[2], sys.argv[3], eval_images=sys.argv[4])
print("RESULT " + json.dumps({"nodes": nodes, "stats": stats}))
"""
SETTINGS = {"image_size": 32, "min_side": 32, "threads": 8, "timeout_s": 5.0, "samples_per_shard": 8,
            "rows_per_partition": 4}


@pytest.fixture
def web(tmp_path):
    server = SampleWeb(tmp_path / "web")
    yield server
    server.stop()


def _url_list(tmp_path: Path, web: SampleWeb) -> tuple[Path, Path]:
    """28 rows in 4 shards: photographs, duplicates of each kind, failures, a filtered row and an evaluation
    image; and the evaluation folder."""
    good = distinct_photo_indices(18)
    url = web.url
    rows = [laion_row(url + photo_path(i), f"photograph {i}") for i in good[:16]]
    rows += [
        laion_row(url + photo_path(good[0]), "exact duplicate"),
        laion_row(url + photo_path(good[1]).replace("/photos/", "/resized/"), "near duplicate"),
        laion_row(url + photo_path(good[2]).replace("/photos/", "/redirect/"), "exact duplicate through a redirect"),
        laion_row(url + photo_path(good[16]), "an evaluation image"),
        laion_row(url + photo_path(good[17]).replace("/photos/", "/noai/"), "noai"),
        laion_row(url + "/status/404.jpg", "404"),
        laion_row(url + "/corrupt.jpg", "corrupt"),
        laion_row(url + "/page.jpg", "html"),
        laion_row(url + "/tiny.png", "tiny"),
        laion_row(url + photo_path(good[3]).replace("/photos/", "/cut/"), "truncated"),
        laion_row(None, "no url"),
        laion_row(url + photo_path(good[4]).replace("/photos/", "/resized/"), "near duplicate, last"),
    ]
    eval_images = tmp_path / "eval" / "val" / "a"
    eval_images.mkdir(parents=True)
    photo = sample_photo(good[16])
    photo.resize((photo.width * 9 // 10, photo.height * 9 // 10)).save(eval_images / "copy.png")
    return write_url_list(tmp_path / "laion.parquet", rows), tmp_path / "eval"


def _shard_contents(folder: Path) -> dict[str, list[tuple[str, bytes, dict]]]:
    return {shard.name: [(sample["__key__"], sample["jpg"], sample["json"]) for sample in iter_samples([shard])]
            for shard in list_shards(folder, "web")}


def test_ingestion_on_two_nodes_gives_the_single_process_result(cluster, tmp_path, web):
    url_list, eval_images = _url_list(tmp_path, web)
    config = with_overrides(get_preset("tiny"), {f"data.ingest.{key}": value for key, value in SETTINGS.items()})
    alone = run_ingest(config, url_list, tmp_path / "alone", eval_images=eval_images)

    overrides = {**{f"data.ingest.{key}": value for key, value in SETTINGS.items()}, "data.ingest.distributor": "ray"}
    result = _driver(_INGEST, json.dumps(overrides), str(url_list), str(tmp_path / "cluster"), str(eval_images),
                     cluster=cluster, **{FAULT_ENV: "2"})
    assert result["nodes"] == 2
    assert (tmp_path / "cluster" / "_ingest" / "fault-injected").exists(), "the judging task was not killed"
    stats = {key: value for key, value in result["stats"].items() if key != "output"}
    assert stats == {key: value for key, value in alone.items() if key != "output"}
    assert alone["duplicates"] == 4 and alone["decontaminated"] == 1 and alone["kept"] == 16
    on_cluster, alone_manifest = (pq.read_table(tmp_path / run / "manifest.parquet") for run in ("cluster", "alone"))
    assert on_cluster.equals(alone_manifest)
    assert _shard_contents(tmp_path / "cluster") == _shard_contents(tmp_path / "alone")
