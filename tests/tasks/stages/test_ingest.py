"""Ingestion end to end: img2dataset against a real HTTP server on 127.0.0.1 serving real photographs
and every bad case, then the clean shards, the manifest, the stats, the resume after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.fixtures.web import SampleWeb, distinct_photo_indices, laion_row, photo_path, sample_photo, write_url_list
from tasks.stages.ingest import IngestLayout, exclusive_use, run_ingest
from tests.tasks.conftest import wait_until_session_ends
from vip_core.config import get_preset, with_overrides
from vip_core.data.shards import iter_samples, list_shards, sample_image


ROOT = Path(__file__).resolve().parents[3]

VIP = [sys.executable, "-m", "tasks.cli"]


@pytest.fixture
def web(tmp_path):
    server = SampleWeb(tmp_path / "web", slow_s=12.0)
    yield server
    server.stop()


def _config(**ingest):
    settings = {"image_size": 32, "min_side": 32, "threads": 8, "timeout_s": 5.0, "samples_per_shard": 16, **ingest}
    return with_overrides(get_preset("tiny"), {f"data.ingest.{key}": value for key, value in settings.items()})


def _check_counts_add_up(stats):
    assert stats["input"] == stats["downloaded"] + sum(stats["failed"].values())
    assert stats["downloaded"] == (
        sum(stats["filtered"].values()) + stats["duplicates"] + stats["decontaminated"] + stats["kept"]
    )


def _read_shards(output):
    samples = list(iter_samples(list_shards(output, "web")))
    keys = [sample["__key__"] for sample in samples]
    assert len(keys) == len(set(keys)), "a sample appears twice"
    return samples


def test_ingest_keeps_good_photographs_and_counts_every_bad_case(tmp_path, web):
    good = distinct_photo_indices(14)
    url = web.url
    contaminated, near_copied, redirected = good[11], good[12], good[13]
    rows = [laion_row(url + photo_path(i), f"photograph {i}") for i in good[:11]]
    rows += [
        laion_row(url + photo_path(contaminated), "an evaluation image"),
        laion_row(url + photo_path(near_copied), "kept first"),
        laion_row(url + photo_path(redirected).replace("/photos/", "/redirect/"), "reached through a redirect"),
        laion_row(url + photo_path(good[0]), "exact duplicate"),
        laion_row(url + photo_path(near_copied).replace("/photos/", "/resized/"), "near duplicate"),
        laion_row(url + photo_path(good[1]).replace("/photos/", "/noai/"), "noai"),
        laion_row(url + photo_path(good[2]).replace("/photos/", "/slow/"), "time-out"),
        laion_row(url + photo_path(good[3]).replace("/photos/", "/cut/"), "truncated image"),
        laion_row(url + photo_path(good[4]).replace("/photos/", "/hangup/"), "truncated body"),
        laion_row(url + "/status/404.jpg", "404"),
        laion_row(url + "/status/500.jpg", "500"),
        laion_row(url + "/loop.jpg", "redirect loop"),
        laion_row(url + "/corrupt.jpg", "corrupt"),
        laion_row(url + "/page.jpg", "html"),
        laion_row(url + "/empty.jpg", "empty"),
        laion_row(url + "/bomb.png", "decompression bomb"),
        laion_row(url + "/tiny.png", "tiny"),
        laion_row(url + "/wide.jpg", "wide"),
        laion_row(url + photo_path(9_001), "tagged", nsfw="NSFW"),
        laion_row(url + photo_path(9_002), "dissimilar caption", similarity=0.1),
        laion_row(None, "no url"),
        laion_row("not a url", "malformed url"),
    ]
    url_list = write_url_list(tmp_path / "laion.parquet", rows)
    eval_images = tmp_path / "eval" / "val" / "class_a"
    eval_images.mkdir(parents=True)
    photo = sample_photo(contaminated)
    photo.resize((photo.width * 9 // 10, photo.height * 9 // 10)).save(eval_images / "copy.png")
    sample_photo(9_999).save(eval_images / "unrelated.png")
    config = _config(conditions=("similarity >= 0.28",))

    stats = run_ingest(config, url_list, tmp_path / "out", eval_images=tmp_path / "eval")

    assert {key: stats[key] for key in ("input", "downloaded", "failed", "filtered")} == {
        "input": 33,
        "downloaded": 20,
        "failed": {
            "bad_url": 1, "corrupt": 1, "decompression_bomb": 1, "empty_body": 1, "http_404": 1, "http_500": 1,
            "no_url": 1, "noai": 1, "not_an_image": 1, "redirect": 1, "timeout": 1, "truncated": 2,
        },
        "filtered": {"aspect_ratio": 1, "condition: similarity >= 0.28": 1, "min_side": 1, "nsfw": 1},
    }
    assert (stats["duplicates"], stats["decontaminated"], stats["kept"]) == (2, 1, 13)
    _check_counts_add_up(stats)
    assert json.loads((tmp_path / "out" / "stats.json").read_text()) == {
        key: value for key, value in stats.items() if key not in ("output", "shards")
    }

    samples = _read_shards(tmp_path / "out")
    kept_urls = {sample["json"]["url"] for sample in samples}
    assert len(samples) == 13
    assert url + photo_path(contaminated) not in kept_urls
    assert url + photo_path(near_copied) in kept_urls
    assert url + photo_path(redirected).replace("/photos/", "/redirect/") in kept_urls
    assert all(sample_image(sample).size == (32, 32) for sample in samples)
    assert {sample["json"]["caption"] for sample in samples} >= {"photograph 0", "reached through a redirect"}

    manifest = pq.read_table(tmp_path / "out" / "manifest.parquet").to_pylist()
    assert [record["row"] for record in manifest] == list(range(33))
    by_caption = {rows[record["row"]]["TEXT"]: record for record in manifest}
    assert by_caption["near duplicate"]["status"] == "duplicate"
    assert by_caption["near duplicate"]["reason"] == "perceptual"
    assert by_caption["exact duplicate"]["duplicate_of"] == by_caption["photograph 0"]["key"]
    assert by_caption["an evaluation image"]["duplicate_of"].endswith("copy.png")
    assert Counter(record["status"] for record in manifest)["kept"] == 13

    requests_before = sum(web.requests.values())
    again = run_ingest(config, url_list, tmp_path / "out", eval_images=tmp_path / "eval")
    assert again == stats
    assert sum(web.requests.values()) == requests_before, "a finished ingestion fetched again"
    with pytest.raises(ValueError, match="choose another output folder"):
        run_ingest(_config(conditions=("similarity >= 0.3",)), url_list, tmp_path / "out", eval_images=tmp_path / "eval")


def test_ingest_killed_mid_run_resumes_without_fetching_finished_shards(tmp_path, web):
    web.slow_s = 120.0
    good = distinct_photo_indices(12)
    first_shard = [web.url + photo_path(i) for i in good[:6]]
    held_shard = [web.url + photo_path(i).replace("/photos/", "/slow/") for i in good[6:]]
    url_list = write_url_list(tmp_path / "laion.jsonl", [laion_row(u, "photograph") for u in first_shard + held_shard])
    command = VIP + [
        "ingest", "--url-list", str(url_list), "--output", str(tmp_path / "out"), "--image-size", "32",
        "--samples-per-shard", "6", "--threads", "6", "--timeout", "60",
    ]
    killed = subprocess.Popen(command, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_until(lambda: IngestLayout(tmp_path / "out").judged_part(0).exists() and _slow_requests(web) > 0, killed)
    finally:
        os.kill(killed.pid, signal.SIGKILL)  # a `kill -9` of the command: its child stops what it started, then itself
        killed.wait()
    wait_until_session_ends(killed.pid)
    assert not (tmp_path / "out" / "stats.json").exists()
    slow_before = _slow_requests(web)
    web.release.set()

    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400)

    assert finished.returncode == 0, finished.stderr
    stats = json.loads(finished.stdout)
    assert (stats["input"], stats["kept"], stats["shards"]) == (12, 12, 2)
    _check_counts_add_up(stats)
    assert all(web.requests[url.removeprefix(web.url)] == 1 for url in first_shard), web.requests
    assert _slow_requests(web) - slow_before >= len(held_shard), "the held shard was not fetched again"
    samples = _read_shards(tmp_path / "out")
    assert sorted(sample["json"]["url"] for sample in samples) == sorted(first_shard + held_shard)


def _slow_requests(web):
    return sum(count for path, count in web.requests.items() if path.startswith("/slow/"))


def _wait_until(condition, process, timeout_s=300.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, process.communicate()[1].decode()[-2000:]
        assert time.monotonic() < deadline, "timed out waiting for the first shard"
        time.sleep(0.1)


def test_an_output_folder_in_use_is_refused(tmp_path):
    url_list = write_url_list(tmp_path / "laion.parquet", [laion_row("http://127.0.0.1:9/a.jpg", "a")])
    with exclusive_use(IngestLayout(tmp_path / "out")):
        with pytest.raises(ValueError, match="being written by another ingestion"):
            run_ingest(_config(), url_list, tmp_path / "out")
    assert not (tmp_path / "out" / "stage.json").exists()


@pytest.mark.slow
def test_two_download_processes_on_a_larger_list_keep_every_distinct_photograph(tmp_path, web):
    good = distinct_photo_indices(150)
    rows = [laion_row(web.url + photo_path(i), f"photograph {i}") for i in good]
    rows += [laion_row(web.url + photo_path(i), "exact duplicate") for i in good[::10]]
    url_list = write_url_list(tmp_path / "laion.parquet", rows)

    stats = run_ingest(_config(processes=2, samples_per_shard=20), url_list, tmp_path / "out")

    assert (stats["input"], stats["kept"], stats["duplicates"], stats["shards"]) == (165, 150, 15, 8)
    _check_counts_add_up(stats)
    samples = _read_shards(tmp_path / "out")
    assert sorted(sample["json"]["url"] for sample in samples) == sorted(row["URL"] for row in rows[:150])
