"""Atomic writes: the target appears whole or not at all; a failed or killed writer leaves no half file."""

from __future__ import annotations

import json

import pytest

from vip_core.atomic import atomic_path, partial_path, remove_partials, write_json, write_text


def test_a_file_appears_only_when_the_block_ends(tmp_path):
    target = tmp_path / "sub" / "result.json"
    with atomic_path(target) as partial:
        partial.write_text("{}")
        assert not target.exists() and partial.name.startswith(".result.json.") and partial.name.endswith(".partial")
    assert target.read_text() == "{}" and not partial.exists()


def test_a_failed_writer_leaves_the_old_file_and_no_partial(tmp_path):
    target = write_text(tmp_path / "stats.json", "old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as partial:
            partial.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old" and list(tmp_path.iterdir()) == [target]


def test_a_folder_replaces_the_old_folder_whole(tmp_path):
    target = tmp_path / "checkpoint"
    target.mkdir()
    (target / "old.pt").write_text("old")
    with atomic_path(target) as staging:
        staging.mkdir()
        (staging / "new.pt").write_text("new")
    assert [path.name for path in target.iterdir()] == ["new.pt"]
    assert [path.name for path in tmp_path.iterdir()] == ["checkpoint"]


def test_partials_of_killed_writers_are_removed(tmp_path):
    write_json(tmp_path / "kept.json", {"a": 1})
    (tmp_path / "deep").mkdir()
    for stale in (partial_path(tmp_path / "shard-000001.tar"), partial_path(tmp_path / "deep" / "x.json")):
        stale.write_text("half")
    remove_partials(tmp_path)
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["deep", "kept.json"]
    assert json.loads((tmp_path / "kept.json").read_text()) == {"a": 1}
