"""Duplicate detection: exact content hashes, 64-bit perceptual hashes, and a near-duplicate index.

The index answers "is there a stored hash within Hamming distance d of this one?" without scanning
everything: it is multi-index hashing. The 64 bits are cut into d + 1 bands; two hashes within distance
d agree exactly on at least one band (pigeonhole), so only the hashes sharing a band are compared.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Iterator

import imagehash
import numpy as np
from PIL import Image

from vip_core.data.shards import IMAGE_EXTENSIONS

logger = logging.getLogger(__name__)

HASH_BITS = 64
_BRUTE_FORCE_BANDS = 16


def content_hash(body: bytes) -> str:
    """The sha256 hex digest of the bytes, as img2dataset computes it."""
    return hashlib.sha256(body).hexdigest()


def perceptual_hash(image: Image.Image) -> int:
    """The 64-bit DCT perceptual hash (imagehash's ``phash``) as an unsigned integer."""
    bits = imagehash.phash(image).hash.flatten()  # bits: [64]
    return int("".join("1" if bit else "0" for bit in bits), 2)


def hamming_distance(first: int, second: int) -> int:
    """The number of bits in which two 64-bit hashes differ."""
    return (first ^ second).bit_count()


class NearDuplicateIndex:
    """Stores 64-bit hashes with a label and finds a stored one within ``max_distance`` bits.

    Args:
        max_distance: the largest Hamming distance that counts as a near duplicate (0 = identical hash).
    """

    def __init__(self, max_distance: int) -> None:
        if not 0 <= max_distance <= HASH_BITS:
            raise ValueError(f"max_distance must lie in [0, {HASH_BITS}], got {max_distance}")
        self.max_distance = max_distance
        self._bands = _band_masks(max_distance + 1) if max_distance + 1 <= _BRUTE_FORCE_BANDS else []
        self._tables: list[dict[int, list[int]]] = [defaultdict(list) for _ in self._bands]
        self._hashes: list[int] = []
        self._labels: list[str] = []

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, value: int, label: str) -> None:
        """Stores ``value`` under ``label``."""
        position = len(self._hashes)
        self._hashes.append(value)
        self._labels.append(label)
        for table, mask in zip(self._tables, self._bands):
            table[value & mask].append(position)

    def find(self, value: int) -> str | None:
        """The label of the first stored hash within ``max_distance`` of ``value``, else None."""
        for position in self._candidates(value):
            if hamming_distance(self._hashes[position], value) <= self.max_distance:
                return self._labels[position]
        return None

    def _candidates(self, value: int) -> Iterator[int]:
        if not self._bands:
            yield from range(len(self._hashes))
            return
        seen: set[int] = set()
        for table, mask in zip(self._tables, self._bands):
            for position in table.get(value & mask, ()):
                if position not in seen:
                    seen.add(position)
                    yield position


def _band_masks(count: int) -> list[int]:
    """``count`` disjoint bit masks that together cover the 64 bits, as even in width as possible."""
    edges = np.linspace(0, HASH_BITS, count + 1).round().astype(int)
    return [((1 << int(end - start)) - 1) << int(start) for start, end in zip(edges[:-1], edges[1:])]


class Deduplicator:
    """First-seen-wins duplicate detection by exact content hash, then by perceptual hash.

    Args:
        phash_max_distance: the Hamming distance up to which two images count as near duplicates.
    """

    def __init__(self, phash_max_distance: int) -> None:
        self._exact: dict[str, str] = {}
        self._near = NearDuplicateIndex(phash_max_distance)

    def __len__(self) -> int:
        return len(self._exact)

    def duplicate_of(self, sha256: str, phash: int) -> tuple[str, str] | None:
        """``("exact" | "perceptual", key of the earlier sample)`` if the sample repeats one already added."""
        if sha256 in self._exact:
            return "exact", self._exact[sha256]
        earlier = self._near.find(phash)
        return ("perceptual", earlier) if earlier is not None else None

    def add(self, key: str, sha256: str, phash: int) -> None:
        """Records a kept sample."""
        self._exact.setdefault(sha256, key)
        self._near.add(phash, key)


def iter_image_files(folder: str | Path) -> Iterator[Path]:
    """Image files anywhere below ``folder`` (ImageFolder, COCO and ADE20K layouts alike), sorted."""
    suffixes = {f".{extension}" for extension in IMAGE_EXTENSIONS} | {".bmp", ".gif", ".tif", ".tiff"}
    yield from sorted(path for path in Path(folder).rglob("*") if path.suffix.lower() in suffixes and path.is_file())


def hash_image_files(paths: Iterable[Path]) -> dict[str, int]:
    """Perceptual hashes of image files by path; unreadable files are skipped with a warning."""
    hashes: dict[str, int] = {}
    for path in paths:
        try:
            with Image.open(path) as image:
                image.draft("RGB", (64, 64))
                hashes[str(path)] = perceptual_hash(image.convert("RGB"))
        except (OSError, SyntaxError, ValueError) as error:
            logger.warning("skipping unreadable evaluation image %s: %s", path, error)
    return hashes


def build_contamination_index(folder: str | Path, max_distance: int) -> tuple[NearDuplicateIndex, dict[str, int]]:
    """A near-duplicate index of every image below ``folder``; returns it and the hashes by path.

    Raises:
        FileNotFoundError: the folder does not exist.
        ValueError: it holds no readable image.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"evaluation image folder {folder} does not exist")
    hashes = hash_image_files(iter_image_files(folder))
    if not hashes:
        raise ValueError(f"evaluation image folder {folder} holds no readable image")
    index = NearDuplicateIndex(max_distance)
    for path, value in hashes.items():
        index.add(value, path)
    return index, hashes
