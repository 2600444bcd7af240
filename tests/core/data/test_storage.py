"""Files by local path or fsspec URL: listing, sizes, reading, and uploading into a folder URL (``file://``
here; ``s3://`` against a real S3 server in tests/tasks/stages/test_object_storage.py)."""

from __future__ import annotations

import pytest

from vip_core.data import storage


def test_a_url_and_a_local_folder_list_the_same_files(tmp_path):
    for name in ("b.tar", "a.tar", "c.txt"):
        (tmp_path / name).write_bytes(name.encode())
    local = storage.glob(tmp_path, "*.tar")
    urls = storage.glob(f"file://{tmp_path}", "*.tar")
    assert [path.name for path in local] == ["a.tar", "b.tar"]
    assert [storage.name(url) for url in urls] == ["a.tar", "b.tar"] and all(storage.is_url(url) for url in urls)
    assert [storage.file_size(url) for url in urls] == [5, 5]
    with storage.open_binary(urls[0]) as handle:
        assert handle.read() == b"a.tar"


def test_join_keeps_a_urls_double_slash_and_gives_a_local_path_as_a_path(tmp_path):
    assert storage.join("s3://bucket/eval/", "classification") == "s3://bucket/eval/classification"
    assert storage.join("s3://bucket", "eval", "coco/") == "s3://bucket/eval/coco"
    assert storage.join(str(tmp_path), "eval", "coco") == tmp_path / "eval" / "coco"


def test_put_makes_the_folder_and_writes_every_file(tmp_path):
    source = tmp_path / "src.tar"
    source.write_bytes(b"shard")
    [target] = storage.put([source], f"file://{tmp_path}/out/web")
    assert storage.name(target) == "src.tar" and (tmp_path / "out" / "web" / "src.tar").read_bytes() == b"shard"


@pytest.mark.parametrize("folder", ["missing", "file://{tmp}/missing"])
def test_a_missing_folder_is_a_clear_error(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match="shard folder .*missing does not exist"):
        storage.glob(folder.format(tmp=tmp_path) if "{tmp}" in folder else tmp_path / folder, "*.tar")


def test_download_copies_a_folder_url_whole_and_keeps_a_copy_already_there(tmp_path):
    (tmp_path / "src" / "train" / "a").mkdir(parents=True)
    (tmp_path / "src" / "train" / "a" / "x.png").write_bytes(b"x")
    (tmp_path / "src" / "top.json").write_bytes(b"{}")
    url, target = f"file://{tmp_path}/src", tmp_path / "cache" / "copy"
    assert set(storage.listing(url)) == {"train/a/x.png", "top.json"}
    assert storage.download(url, target) == target
    assert (target / "train" / "a" / "x.png").read_bytes() == b"x" and (target / "top.json").read_bytes() == b"{}"
    (tmp_path / "src" / "top.json").write_bytes(b"[]")
    storage.download(url, target)
    assert (target / "top.json").read_bytes() == b"{}" and sorted(p.name for p in target.parent.iterdir()) == ["copy"]


def test_downloading_a_missing_folder_url_is_a_clear_error_and_leaves_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^folder not found: file://.*/missing$"):
        storage.download(f"file://{tmp_path}/missing", tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
