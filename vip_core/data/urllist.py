"""LAION-format url lists: read parquet, csv or jsonl, find the URL and caption columns, check them.

LAION's columns are ``URL``, ``TEXT``, ``WIDTH``, ``HEIGHT``, ``similarity``, ``NSFW`` (or ``punsafe``)
and ``LICENSE``; other lists use lower-case names. Column names are matched without regard to case.
Problems with the file are raised as ValueError / FileNotFoundError with a one-line message.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from vip_core.data.filters import Condition

URL_COLUMNS = ("url",)
CAPTION_COLUMNS = ("text", "caption")
FORMATS = {".parquet": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}


@dataclass(frozen=True)
class UrlList:
    """A url list held in memory.

    Attributes:
        path: where it was read from.
        table: all its columns, one row per image.
        url_column: the name of its URL column.
        caption_column: the name of its caption column, if any.
    """

    path: Path
    table: pa.Table
    url_column: str
    caption_column: str | None

    def __len__(self) -> int:
        return self.table.num_rows

    def download_urls(self) -> pa.ChunkedArray:
        """The URL of each row as :func:`clean_url` gives it, ``""`` where the row has none (computed in Arrow: no
        Python object per row)."""
        import pyarrow.compute as pc

        urls = pc.utf8_trim_whitespace(self.table.column(self.url_column).cast(pa.string()))
        return pc.fill_null(urls, "")

    def check_conditions(self, conditions: Sequence[Condition]) -> None:
        """Raises ValueError naming the first condition whose column the list lacks."""
        columns = set(self.table.column_names)
        for condition in conditions:
            if condition.column not in columns:
                raise ValueError(
                    f"condition {condition.text!r} names column {condition.column!r}, which url list "
                    f"{self.path} lacks (columns: {', '.join(self.table.column_names)})"
                )


def read_url_list(path: str | Path) -> UrlList:
    """Reads and checks a url list.

    Raises:
        FileNotFoundError: no such file.
        ValueError: unknown extension, unreadable content, no URL column, or no rows.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"url list {path} does not exist")
    table = _read_table(path, _format_of(path))
    url_column = _find_column(table, URL_COLUMNS)
    if url_column is None:
        raise ValueError(f"url list {path} has no URL column (columns: {', '.join(table.column_names) or 'none'})")
    if table.num_rows == 0:
        raise ValueError(f"url list {path} has no rows")
    return UrlList(path=path, table=table, url_column=url_column, caption_column=_find_column(table, CAPTION_COLUMNS))


def file_digest(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _format_of(path: Path) -> str:
    try:
        return FORMATS[path.suffix.lower()]
    except KeyError:
        raise ValueError(f"url list {path} must end in {', '.join(FORMATS)}") from None


def _read_table(path: Path, fmt: str) -> pa.Table:
    try:
        if fmt == "parquet":
            return pq.read_table(path)
        if fmt == "csv":
            return pa_csv.read_csv(path)
        return pa_json.read_json(path)
    except (pa.ArrowException, OSError) as error:
        detail = " ".join(str(error).split())[:200]
        raise ValueError(f"url list {path} is not valid {fmt}: {detail}") from None


def _find_column(table: pa.Table, candidates: Sequence[str]) -> str | None:
    by_lower = {name.lower(): name for name in table.column_names}
    for candidate in candidates:
        if candidate in by_lower:
            return by_lower[candidate]
    return None


def clean_url(value: Any) -> str | None:
    """A URL cell as a string stripped of white space; None where it is missing or blank."""
    if value is None:
        return None
    text = str(value).strip()
    return text or None
