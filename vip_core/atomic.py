"""Atomic writes: a file or a folder appears whole under its name, or not at all.

Every writer in the project goes through :func:`atomic_path` (or :func:`create_text`, which never replaces an
existing file). It hands out a hidden sibling of the target, ``.<name>.<pid>-<thread>.partial``, and renames
it onto the target when the block ends without an error (it is removed when the block raises). A reader never sees half a file, two writers never share a
temporary, and a killed writer leaves only a ``*.partial`` behind, which :func:`remove_partials` clears.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

PARTIAL_SUFFIX = ".partial"


def partial_path(path: str | Path) -> Path:
    """The temporary name this process and thread write ``path`` under."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}{PARTIAL_SUFFIX}")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path to write ``path``'s content to (a file, or a folder to fill), put in place after the block.

    A folder replaces an existing folder of the same name whole. The parent folder is created if missing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    _remove(partial)
    try:
        yield partial
        _put_in_place(partial, path)
    except BaseException:
        _remove(partial)
        raise


def write_bytes(path: str | Path, payload: bytes) -> Path:
    """Writes ``payload`` to ``path`` atomically; returns the path."""
    with atomic_path(path) as partial:
        partial.write_bytes(payload)
    return Path(path)


def write_text(path: str | Path, text: str) -> Path:
    """Writes ``text`` to ``path`` atomically; returns the path."""
    return write_bytes(path, text.encode())


def write_json(path: str | Path, payload: Any, indent: int | None = 2) -> Path:
    """Writes ``payload`` as JSON (values it cannot encode as their ``str``) to ``path`` atomically."""
    return write_text(path, json.dumps(payload, indent=indent, default=str))


def create_text(path: str | Path, text: str) -> bool:
    """Writes ``text`` to ``path`` whole and only if ``path`` does not exist yet: the partial file is linked into
    place, so a killed writer leaves no truncated file and a concurrent first writer's file is never overwritten.
    Returns False when ``path`` existed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    partial.write_text(text)
    try:
        os.link(partial, path)
        return True
    except FileExistsError:
        return False
    finally:
        _remove(partial)


def remove_partials(folder: str | Path, prefix: str = "") -> None:
    """Removes the ``*.partial`` left below ``folder`` by killed writers (of names starting with ``prefix``).

    Call it only while no other writer is at work in the folder.
    """
    folder = Path(folder)
    if folder.is_dir():
        for stale in folder.rglob(f".{prefix}*{PARTIAL_SUFFIX}"):
            _remove(stale)


def _put_in_place(partial: Path, path: Path) -> None:
    if partial.is_dir() and path.is_dir():
        retired = partial_path(path.with_name(path.name + ".old"))
        path.rename(retired)
        partial.rename(path)
        _remove(retired)
        return
    os.replace(partial, path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
