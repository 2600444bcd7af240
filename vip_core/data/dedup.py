"""Duplicate detection: exact content hashes, 64-bit perceptual hashes, and a Hamming-distance index.

Finding the hashes within distance d of a hash without comparing it with every stored one is done with
block keys (Manku, Jain and Das Sarma, "Detecting near-duplicates for web crawling", WWW 2007): the 64 bits
are cut into b = d + 2 blocks; two hashes within distance d differ in at most d blocks, so they agree
exactly on at least k = b - d = 2 of them. A *key* is one choice of k blocks (C(b, k) choices, 15 at d = 4);
two hashes within distance d have equal bits under at least one key's mask, so only hashes sharing a
masked value are compared. Each key covers 2 · 64 / b bits (21 at d = 4), so a masked value is shared by
about n / 2^21 random hashes: the comparisons grow with n² / 2^21, far below n².

:class:`HammingIndex` answers queries against a fixed set of hashes (the evaluation images);
:mod:`vip_core.data.global_dedup` uses the same keys to find every near-duplicate pair of a data set in
partitions.
"""

from __future__ import annotations

import hashlib
import logging
from itertools import combinations
from pathlib import Path
from typing import Iterable, Iterator

import imagehash
import numpy as np
from PIL import Image

from vip_core.data.shards import IMAGE_EXTENSIONS

logger = logging.getLogger(__name__)

HASH_BITS = 64
NOT_FOUND = -1


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


def hamming_distances(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Element-wise bit differences of two uint64 arrays ``[n]``: ``[n]`` uint8."""
    return np.bitwise_count(first ^ second)


class BlockKeys:
    """The keys of the block scheme for Hamming distance ``max_distance`` (see the module's docstring).

    Attributes:
        max_distance: the largest distance that counts as near.
        block_masks: ``[b]`` uint64, the disjoint blocks covering the 64 bits.
        masks: ``[C]`` uint64, one per key: the union of its blocks, keys in lexicographic order of their blocks.
    """

    def __init__(self, max_distance: int) -> None:
        if not 0 <= max_distance <= HASH_BITS:
            raise ValueError(f"max_distance must lie in [0, {HASH_BITS}], got {max_distance}")
        self.max_distance = max_distance
        blocks = min(max_distance + 2, HASH_BITS)
        self.shared = blocks - max_distance  # blocks that two hashes within max_distance agree on, at least
        self.block_masks = _block_masks(blocks)
        self.masks = np.array(
            [np.bitwise_or.reduce(self.block_masks[list(chosen)]) if chosen else 0
             for chosen in combinations(range(blocks), self.shared)],
            dtype=np.uint64,
        )

    def __len__(self) -> int:
        return len(self.masks)

    def first_shared_mask(self, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        """For pairs of hashes ``[m]``, the mask of the first key (in the order of ``masks``) under which they
        agree, or of the first ``shared`` blocks they agree on when there are fewer: ``[m]`` uint64. A pair found
        under several keys is counted under the one whose mask this is."""
        differ = first ^ second  # [m]
        agree = (differ[:, None] & self.block_masks[None, :]) == 0  # [m, b]
        first_blocks = agree & (np.cumsum(agree, axis=1) <= self.shared)  # [m, b]
        return (first_blocks * self.block_masks[None, :]).sum(axis=1, dtype=np.uint64)  # disjoint bits: sum is OR


def _block_masks(count: int) -> np.ndarray:
    """``count`` disjoint bit masks ``[count]`` (uint64) that together cover the 64 bits, as even in width as possible."""
    edges = np.linspace(0, HASH_BITS, count + 1).round().astype(int)
    return np.array([((1 << int(end - start)) - 1) << int(start) for start, end in zip(edges[:-1], edges[1:])],
                    dtype=np.uint64)


def expand_ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(owner, position)``: for every i, ``counts[i]`` rows with owner i and positions ``starts[i]``,
    ``starts[i] + 1``, ... (both ``[sum(counts)]`` int64)."""
    owner = np.repeat(np.arange(len(counts)), counts)  # [t]
    offsets = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)  # [t]
    return owner, np.repeat(starts, counts) + offsets


class HammingIndex:
    """A fixed, ordered set of 64-bit hashes; finds for each query the earliest stored hash within
    ``max_distance`` bits.

    Args:
        hashes: ``[m]`` the stored hashes, in order.
        max_distance: the largest Hamming distance that counts as near (0 = identical hash).
    """

    def __init__(self, hashes: Iterable[int] | np.ndarray, max_distance: int) -> None:
        self.hashes = np.asarray(list(hashes) if not isinstance(hashes, np.ndarray) else hashes, dtype=np.uint64)
        self.keys = BlockKeys(max_distance)
        self._tables: list[tuple[np.ndarray, np.ndarray]] = []  # per key: masked values sorted [m], their positions [m]
        for mask in self.keys.masks:
            masked = self.hashes & mask
            order = np.argsort(masked, kind="stable")
            self._tables.append((masked[order], order))

    def __len__(self) -> int:
        return len(self.hashes)

    def earliest(self, queries: np.ndarray) -> np.ndarray:
        """For queries ``[n]`` (uint64), the position of the earliest stored hash within ``max_distance``, else
        :data:`NOT_FOUND`: ``[n]`` int64."""
        queries = np.asarray(queries, dtype=np.uint64)
        best = np.full(len(queries), len(self.hashes), dtype=np.int64)  # [n]
        for mask, (sorted_masked, order) in zip(self.keys.masks, self._tables):
            masked = queries & mask  # [n]
            low = np.searchsorted(sorted_masked, masked, side="left")
            high = np.searchsorted(sorted_masked, masked, side="right")
            query, at = expand_ranges(low, high - low)  # candidate pairs [t]
            stored = order[at]  # [t]
            near = hamming_distances(queries[query], self.hashes[stored]) <= self.keys.max_distance
            np.minimum.at(best, query[near], stored[near])
        return np.where(best < len(self.hashes), best, NOT_FOUND)


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


def build_contamination_index(folder: str | Path, max_distance: int) -> tuple[HammingIndex, dict[str, int]]:
    """An index of every image below ``folder`` in path order; returns it and the hashes by path (the
    index's positions are the paths' positions in that dict).

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
    return HammingIndex(list(hashes.values()), max_distance), hashes
