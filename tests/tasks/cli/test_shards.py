"""``vip shards``: ``--input`` turns a researcher's folder (or bucket) of images into shards, counting every bad
file and removing duplicates and evaluation images, that ``vip pretrain`` trains on, spending the ε a ``--set``
names; a re-run resumes or refuses in one line. ``--check DIR``: the damaged images named, in this process and on a
local Ray; exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.stages.ingest_shards import FAULT_ENV
from tasks.stages.pretrain import ledger_book
from vip_core.data.shards import iter_samples, list_shards, sample_image
from vip_core.train.data import measure_shards

ROOT = Path(__file__).resolve().parents[3]

VIP = [sys.executable, "-m", "tasks.cli"]


def _shards(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(VIP + ["shards", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def _stats(code: int, out: str, err: str) -> dict:
    assert code == 0, err[-2000:]
    return {key: value for key, value in json.loads(out).items() if key not in ("output", "shards")}


@pytest.fixture(scope="module")
def written(own_images, tmp_path_factory):
    """``vip shards --input`` run once on the researcher's folder: ``(output folder, the command's result)``."""
    output = tmp_path_factory.mktemp("own-shards") / "shards"
    result = _shards("--input", str(own_images["folder"]), "--output", str(output),
                     "--eval-data", str(own_images["eval_data"]))
    return output, result


def test_own_images_become_shards_without_bad_files_duplicates_or_evaluation_images(own_images, written):
    output, result = written
    assert _stats(result.returncode, result.stdout, result.stderr) == own_images["stats"]
    assert json.loads((output / "stats.json").read_text()) == own_images["stats"]
    samples = list(iter_samples(list_shards(output, "web")))
    assert {sample["json"]["path"] for sample in samples} == own_images["kept"]
    assert all(sample_image(sample).size == (32, 32) for sample in samples)
    manifest = {Path(record["url"]).relative_to(own_images["folder"]).as_posix(): record
                for record in pq.read_table(output / "manifest.parquet").to_pylist()}
    keys = {path: record["key"] for path, record in manifest.items()}
    assert {path: record["duplicate_of"] for path, record in manifest.items() if record["status"] == "duplicate"} == {
        copy: keys[original] for copy, original in own_images["duplicates"].items()}
    assert manifest["2024/zoo/IMG_0006.jpg"]["status"] == "decontaminated"
    assert manifest["moved-away.jpg"]["reason"] == "unreadable" and ".DS_Store" not in manifest


def test_pretraining_reads_the_shards_spends_the_epsilon_set_and_charges_their_ledger(own_images, written, tmp_path,
                                                                                      vip_here):
    output, _ = written
    code, out, err = vip_here("pretrain", "--stage", "private", "--data", str(output), "--output",
                              str(tmp_path / "run"), "--steps", "2", "--batch-size", "4", "--physical-batch-size", "4",
                              "--workers", "1", "--cpus-per-worker", "0.5", "--set", "privacy.target_epsilon=4")
    assert code == 0, err[-3000:]
    trained = json.loads(out)
    assert (trained["steps"], trained["dataset_size"]) == (2, own_images["stats"]["kept"])
    assert 3.8 < trained["epsilon"] <= 4.0, trained  # σ is calibrated to 0.1 %: ε just below the target
    saved = json.loads((tmp_path / "run" / "result.json").read_text())["config"]
    assert saved["privacy"]["target_epsilon"] == 4.0 and saved["private"]["steps"] == 2
    [charge] = ledger_book(measure_shards(output).fingerprint).charges()
    assert (charge.steps, charge.purpose) == (2, "pretrain-dp")


def test_a_rerun_returns_the_counts_and_changed_images_are_refused_in_one_line(own_images, written, tmp_path,
                                                                              vip_here):
    output, first = written
    shards = {path: path.stat().st_mtime_ns for path in list_shards(output, "web")}
    assert _stats(*vip_here("shards", "--input", str(own_images["folder"]), "--output", str(output),
                            "--eval-data", str(own_images["eval_data"]))) == own_images["stats"]
    changed = tmp_path / "photos"
    subprocess.run(["cp", "-a", str(own_images["folder"]), str(changed)], check=True)
    (changed / "2024" / "IMG_0001 (2).jpg").write_bytes((changed / "2023" / "IMG_0002.jpg").read_bytes())
    code, _, err = vip_here("shards", "--input", str(changed), "--output", str(output),
                            "--eval-data", str(own_images["eval_data"]))
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("vip shards: error: ") and "choose another output folder" in err
    assert {path: path.stat().st_mtime_ns for path in list_shards(output, "web")} == shards
    assert json.loads((output / "stats.json").read_text()) == own_images["stats"]


def test_a_run_killed_while_judging_resumes_to_the_same_shards(own_images, written, tmp_path, vip_here):
    arguments = ["--input", str(own_images["folder"]), "--output", str(tmp_path / "out"),
                 "--eval-data", str(own_images["eval_data"]), "--samples-per-shard", "4"]
    killed = _shards(*arguments, env={FAULT_ENV: "1"})
    assert killed.returncode == 128 + 9 and not (tmp_path / "out" / "stats.json").exists()  # its worker SIGKILLed
    assert _stats(*vip_here("shards", *arguments)) == own_images["stats"]
    resumed = sorted(sample["json"]["path"] for sample in iter_samples(list_shards(tmp_path / "out", "web")))
    assert resumed == sorted(own_images["kept"])


def test_ray_tasks_give_the_same_shards_and_counts(own_images, written, tmp_path, vip_here):
    output, _ = written
    stats = _stats(*vip_here("shards", "--input", str(own_images["folder"]), "--output", str(tmp_path / "out"),
                             "--eval-data", str(own_images["eval_data"]), "--distributor", "ray"))
    assert stats == own_images["stats"]
    assert [path.read_bytes() for path in list_shards(tmp_path / "out", "web")] == [
        path.read_bytes() for path in list_shards(output, "web")]


def test_images_in_a_bucket_give_the_same_shards(own_images, s3, tmp_path, vip_here):
    s3.mkdir("own-images")
    for path in own_images["folder"].rglob("*"):
        if path.is_file():
            s3.put_file(str(path), f"own-images/photos/{path.relative_to(own_images['folder']).as_posix()}")
    stats = _stats(*vip_here("shards", "--input", "s3://own-images/photos", "--output", str(tmp_path / "out"),
                             "--eval-data", str(own_images["eval_data"])))
    failed = {reason: count for reason, count in own_images["stats"]["failed"].items() if reason != "unreadable"}
    assert stats == {**own_images["stats"], "input": 12, "failed": failed}
    samples = list(iter_samples(list_shards(tmp_path / "out", "web")))
    assert {sample["json"]["path"] for sample in samples} == own_images["kept"]
    assert all(sample["json"]["url"].startswith("s3://own-images/photos/") for sample in samples)


def test_bad_arguments_of_shards_are_one_line(own_images, tmp_path, vip_here):
    program = _shards("--input", str(own_images["folder"]))  # the program itself, once
    results = [((program.returncode, program.stdout, program.stderr), "--input needs --output")]
    for argv, message in [
        (["--input", str(own_images["folder"]), "--check", str(tmp_path)], "not allowed with argument"),
        (["--check", str(tmp_path), "--eval-data", str(tmp_path)], "--eval-data does not go with --check"),
        (["--input", str(tmp_path / "nowhere"), "--output", str(tmp_path / "out")], "does not exist"),
    ]:
        results.append((vip_here("shards", *argv), message))
    for (code, _, err), message in results:
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert err.startswith("vip shards: error: ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("distributor", ["multiprocessing", "ray"])
def test_the_check_names_each_damaged_image_and_exits_1(damaged_shards, distributor, vip_here):
    folder, damaged = damaged_shards
    code, out, err = vip_here("shards", "--check", str(folder), "--distributor", distributor)
    assert code == 1, err[-2000:]
    report = json.loads(out)
    assert (report["shards"], report["images"], report["unreadable"], report["ok"]) == (2, 64, [], False)
    assert {item["member"]: Path(item["shard"]).name for item in report["damaged"]} == damaged


def test_clean_shards_pass_and_a_missing_folder_is_one_line(noise_shards, tmp_path, vip_here):
    result = _shards("--check", str(noise_shards(64)))
    assert result.returncode == 0 and json.loads(result.stdout)["damaged"] == []
    code, _, err = vip_here("shards", "--check", str(tmp_path / "nowhere"))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("vip shards: error: shard folder") and "does not exist" in err
