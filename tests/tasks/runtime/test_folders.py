"""Stage folders: one claim per folder, one mismatch policy (refuse, naming the difference), stored results."""

from __future__ import annotations

import os

import pytest

from tasks.runtime.folders import StageFolder, digest, fingerprint, identity
from vip_core.atomic import partial_path


def test_the_same_fingerprint_resumes_and_returns_the_stored_result(tmp_path):
    folder = StageFolder(tmp_path / "render", "render", {"size": 32, "seed": 0}).claim()
    assert folder.stored_result() is None
    folder.store_result({"images": 48})
    partial_path(tmp_path / "render" / "shard-000003.tar").write_text("half")
    again = StageFolder(tmp_path / "render", "render", {"seed": 0, "size": 32}).claim()
    assert again.stored_result() == {"images": 48}
    assert sorted(path.name for path in (tmp_path / "render").iterdir()) == ["result.json", "stage.json"]


def test_another_fingerprint_or_stage_is_refused_naming_the_difference(tmp_path):
    StageFolder(tmp_path, "render", {"settings": {"size": 32, "seed": 0}}).claim().store_result({"images": 48})
    with pytest.raises(ValueError, match=r"made with settings.size=32, not 48: choose another output folder"):
        StageFolder(tmp_path, "render", {"settings": {"size": 48, "seed": 0}}).stored_result()
    with pytest.raises(ValueError, match="holds the render stage's work, not ingest's"):
        StageFolder(tmp_path, "ingest", {"settings": {"size": 32, "seed": 0}}).claim()


def test_an_unclaimed_folder_has_no_stored_result_and_stays_unclaimed(tmp_path):
    folder = StageFolder(tmp_path / "eval", "eval/linprobe", {"data": "/d"}, result_name="metrics.json")
    assert folder.stored_result() is None and not (tmp_path / "eval").exists()
    assert folder.result_file == tmp_path / "eval" / "metrics.json"


def test_a_fingerprint_follows_the_files_of_a_folder(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"weights one")
    before = fingerprint(tmp_path)
    assert fingerprint(tmp_path) == before and digest(before) == digest(fingerprint(tmp_path))
    (tmp_path / "checkpoint.pt").write_bytes(b"weights two, retrained")
    os.utime(tmp_path / "checkpoint.pt", ns=(1, 1))
    assert fingerprint(tmp_path) != before
    assert fingerprint(tmp_path / "nothing")[1] == "missing" and fingerprint(None) is None


def test_a_url_is_named_by_its_listing_and_a_local_path_by_its_resolved_path(tmp_path):
    (tmp_path / "set" / "train").mkdir(parents=True)
    (tmp_path / "set" / "train" / "a.png").write_bytes(b"one")
    url = f"file://{tmp_path}/set"
    before = identity(url)
    assert before.startswith(f"{url}#") and identity(url) == before and fingerprint(url) == [before]
    (tmp_path / "set" / "train" / "a.png").write_bytes(b"one, rewritten")
    assert identity(url) != before
    assert identity(tmp_path / "set" / ".." / "set") == str(tmp_path / "set")
    assert fingerprint(f"file://{tmp_path}/nothing") == [f"file://{tmp_path}/nothing", "missing"]
    with pytest.raises(FileNotFoundError, match="^folder not found: file://"):
        identity(f"file://{tmp_path}/nothing")
