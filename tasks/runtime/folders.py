"""Stage folders: where a stage writes, what work the folder holds, and what happens when that differs.

A stage folder holds the work of one stage for one *fingerprint*: a JSON-able dict of everything that
decides the stage's output (the settings that change the result, and the identity of the inputs; settings
that change only the speed are left out). :meth:`StageFolder.claim` records it in ``stage.json`` the
first time and checks it every later time.

The mismatch policy, the same for every stage: a folder claimed for another fingerprint is refused with
a ``ValueError`` naming the folder and the first field that differs; nothing in it is overwritten or
recomputed behind the user's back. Choose another output folder (the flows name theirs after the
fingerprint's config slice and inputs, so they never meet this). With the same fingerprint the stage
resumes: the pieces already written are kept (each was written whole, :mod:`vip_core.atomic`) and a
stored result (``result.json``) is returned as it is.

An input is a local path or an fsspec URL (:mod:`vip_core.data.storage`): :func:`identity` names it (a URL with
the listing of its files), :func:`fingerprint` follows its files, :func:`eval_data_copy` gives a URL's evaluation
data as a local folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tasks.runtime.environment import state_paths
from vip_core.atomic import remove_partials, write_json
from vip_core.data import storage

CLAIM_FILE = "stage.json"
RESULT_FILE = "result.json"


@dataclass(frozen=True)
class StageFolder:
    """The output folder of ``stage`` for ``fingerprint``.

    Args:
        path: the folder.
        stage: the stage's name (``render``, ``eval/linprobe``): part of the claim.
        fingerprint: what decides the stage's output, JSON-able.
        result_name: the file name of the stored result.
    """

    path: str | Path
    stage: str
    fingerprint: dict[str, Any]
    result_name: str = RESULT_FILE

    def claim(self) -> "StageFolder":
        """Makes the folder this stage's for this fingerprint, or checks that it already is.

        Clears the ``*.partial`` files a killed writer left. Claim once the inputs have been checked, so that
        a mistyped input does not leave a folder claimed for it.

        Raises:
            ValueError: the folder holds another stage's work, or this stage's for another fingerprint.
        """
        if not self._claimed():
            write_json(Path(self.path) / CLAIM_FILE, self._claim_record())
        remove_partials(self.path)
        return self

    def stored_result(self) -> dict[str, Any] | None:
        """The result a finished run stored, or None.

        Raises:
            ValueError: the folder is claimed for another stage or fingerprint.
        """
        if not self._claimed() or not self.result_file.is_file():
            return None
        return json.loads(self.result_file.read_text())

    def store_result(self, result: dict[str, Any]) -> dict[str, Any]:
        """Stores the stage's result (whole, atomically) and returns it."""
        write_json(self.result_file, result)
        return result

    @property
    def result_file(self) -> Path:
        """Where the stored result is."""
        return Path(self.path) / self.result_name

    def _claim_record(self) -> dict[str, Any]:
        return {"stage": self.stage, "fingerprint": _jsonable(self.fingerprint)}

    def _claimed(self) -> bool:
        """True when the folder is claimed for this stage and fingerprint; False when unclaimed; else raises."""
        claim_file = Path(self.path) / CLAIM_FILE
        if not claim_file.is_file():
            return False
        _check_same(Path(self.path), json.loads(claim_file.read_text()), self._claim_record())
        return True


def identity(path: str | Path) -> str:
    """What names an input: a local path resolved; a URL with the digest of its files' listing
    (``s3://b/digits#1a2b…``), so that a file added, removed or rewritten in the bucket is other data.

    Raises:
        FileNotFoundError: no file below the URL.
    """
    if not storage.is_url(path):
        return str(Path(path).resolve())
    return f"{path}#{digest(storage.listing(str(path)))[:16]}"


def fingerprint(path: str | Path | None) -> Any:
    """An input path's identity: the path with the size and mtime of the file, or of each file at the top of
    the folder (shards, ``checkpoint.pt``, the class folders of an ImageFolder); a URL with its listing
    (:func:`identity`); ``"missing"`` when absent."""
    if path is None:
        return None
    if storage.is_url(path):
        return _url_fingerprint(str(path))
    path = Path(path).resolve()
    if path.is_file():
        return [str(path), _stat(path)]
    if path.is_dir():
        return [str(path), sorted((child.name, _stat(child)) for child in path.iterdir())]
    return [str(path), "missing"]


@contextlib.contextmanager
def eval_data_copy(data: str, data_identity: str) -> Iterator[str]:
    """Evaluation data as a local folder, for the block: ``data`` when it is local; a URL's files copied once into
    ``$VIP_HOME/data/eval/<digest of data_identity>``, and an error of the block about the copy names the URL."""
    if not storage.is_url(data):
        yield data
        return
    local = str(storage.download(data, state_paths()["data"] / "eval" / digest(data_identity)[:16]))
    try:
        yield local
    except (FileNotFoundError, ValueError) as error:
        kind = FileNotFoundError if isinstance(error, FileNotFoundError) else ValueError
        raise kind(str(error).replace(local, data)) from None


def digest(payload: Any) -> str:
    """The sha256 of the payload's canonical JSON."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _check_same(folder: Path, found: dict[str, Any], wanted: dict[str, Any]) -> None:
    if found.get("stage") != wanted["stage"]:
        raise ValueError(f"{folder} holds the {found.get('stage')} stage's work, not {wanted['stage']}'s: "
                         "choose another output folder")
    difference = _first_difference(found.get("fingerprint", {}), wanted["fingerprint"])
    if difference is not None:
        key, old, new = difference
        raise ValueError(f"{folder} holds {wanted['stage']} work made with {key}={old!r}, not {new!r}: "
                         "choose another output folder")


def _first_difference(found: Any, wanted: Any, prefix: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(found, dict) and isinstance(wanted, dict):
        for key in sorted(set(found) | set(wanted)):
            difference = _first_difference(found.get(key), wanted.get(key), f"{prefix}{key}.")
            if difference is not None:
                return difference
        return None
    return None if found == wanted else (prefix.rstrip("."), found, wanted)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _url_fingerprint(url: str) -> list[str]:
    try:
        return [identity(url)]
    except FileNotFoundError:
        return [url, "missing"]


def _stat(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]
