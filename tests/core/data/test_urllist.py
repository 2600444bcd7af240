"""Reading LAION-format url lists in each format, and the one-line errors for bad ones."""

from __future__ import annotations

import pytest

from tasks.fixtures.web import laion_row, write_url_list
from vip_core.data.filters import parse_condition
from vip_core.data.urllist import read_url_list

ROWS = [laion_row("http://127.0.0.1:1/a.jpg", "a cat"), laion_row(None, "no url"), laion_row("  ", "blank")]


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".jsonl"])
def test_each_format_reads_the_same_rows(tmp_path, suffix):
    urls = read_url_list(write_url_list(tmp_path / f"list{suffix}", ROWS))
    assert len(urls) == 3
    assert (urls.url_column, urls.caption_column) == ("URL", "TEXT")
    assert urls.download_urls().to_pylist() == ["http://127.0.0.1:1/a.jpg", "", ""]
    assert urls.table.column("similarity")[0].as_py() == pytest.approx(0.32)


def test_lower_case_columns_are_found(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"url": "http://127.0.0.1:1/a.jpg", "caption": "x"}\n')
    urls = read_url_list(path)
    assert (urls.url_column, urls.caption_column) == ("url", "caption")


def test_bad_url_lists_raise_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_url_list(tmp_path / "missing.parquet")
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match="is not valid parquet") as error:
        read_url_list(garbage)
    assert "\n" not in str(error.value)
    (tmp_path / "list.txt").write_text("http://127.0.0.1:1/a.jpg\n")
    with pytest.raises(ValueError, match="must end in"):
        read_url_list(tmp_path / "list.txt")
    (tmp_path / "nourl.csv").write_text("TEXT,WIDTH\na cat,3\n")
    with pytest.raises(ValueError, match="no URL column"):
        read_url_list(tmp_path / "nourl.csv")


def test_conditions_must_name_existing_columns(tmp_path):
    urls = read_url_list(write_url_list(tmp_path / "list.parquet", ROWS))
    urls.check_conditions([parse_condition("similarity > 0.1")])
    with pytest.raises(ValueError, match="names column 'aesthetic'"):
        urls.check_conditions([parse_condition("aesthetic > 5")])
