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


def test_put_makes_the_folder_and_writes_every_file(tmp_path):
    source = tmp_path / "src.tar"
    source.write_bytes(b"shard")
    [target] = storage.put([source], f"file://{tmp_path}/out/web")
    assert storage.name(target) == "src.tar" and (tmp_path / "out" / "web" / "src.tar").read_bytes() == b"shard"


@pytest.mark.parametrize("folder", ["missing", "file://{tmp}/missing"])
def test_a_missing_folder_is_a_clear_error(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match="shard folder .*missing does not exist"):
        storage.glob(folder.format(tmp=tmp_path) if "{tmp}" in folder else tmp_path / folder, "*.tar")
