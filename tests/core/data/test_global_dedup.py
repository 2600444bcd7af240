"""The partitioned deduplication against one sequential pass, on hashes with every kind of duplicate."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.runtime.runner import LocalRunner
from vip_core.data.global_dedup import (
    CONTENT_DTYPE, EXACT, PERCEPTUAL, Candidates, deduplicate, merge_decisions, partition_count,
)


def sequential_decisions(candidates: Candidates, max_distance: int) -> dict[int, tuple[int, int]]:
    """The reference: candidates one by one in id order against the kept ones; ``{id: (reason, duplicate_of)}``
    for every candidate not kept."""
    kept_content: dict[bytes, int] = {}
    kept_ids: list[int] = []
    kept_hashes: list[int] = []
    decisions = {}
    for position in np.argsort(candidates.ids):
        identifier, content, phash = (int(candidates.ids[position]), bytes(candidates.content[position]),
                                      int(candidates.phash[position]))
        if content in kept_content:
            decisions[identifier] = (EXACT, kept_content[content])
            continue
        near = [kept for kept, value in zip(kept_ids, kept_hashes) if (value ^ phash).bit_count() <= max_distance]
        if near:
            decisions[identifier] = (PERCEPTUAL, min(near))
            continue
        kept_content[content] = identifier
        kept_ids.append(identifier)
        kept_hashes.append(phash)
    return decisions


def _flip(value: int, bits: list[int]) -> int:
    for bit in bits:
        value ^= 1 << bit
    return value


def hashes_with_duplicates(seed: int, originals: int, max_distance: int) -> Candidates:
    """Random originals, then exact copies, twins (same hash, other content), near copies and chains of near
    copies (each link within ``max_distance`` of the last, the ends farther apart), under shuffled ids."""
    rng = np.random.default_rng(seed)
    phash = [int(value) for value in rng.integers(0, 2**64, originals, dtype=np.uint64)]
    content = [f"{index:032x}" for index in range(originals)]
    step = max(1, max_distance // 2 + 1) if max_distance else 0
    for _ in range(originals // 2):
        index = int(rng.integers(len(phash)))  # an original or a copy made earlier
        kind = rng.integers(4)
        if kind == 0:  # an exact copy
            phash.append(phash[index]); content.append(content[index])
        elif kind == 1:  # a twin: the same perceptual hash, other bytes
            phash.append(phash[index]); content.append(f"t{len(content):031x}")
        elif kind == 2:  # a near copy
            phash.append(_flip(phash[index], rng.choice(64, rng.integers(0, max_distance + 1), replace=False).tolist()))
            content.append(f"n{len(content):031x}")
        else:  # a chain of near copies
            value = phash[index]
            for _ in range(int(rng.integers(2, 6))):
                value = _flip(value, rng.choice(64, step, replace=False).tolist())
                phash.append(value); content.append(f"c{len(content):031x}")
    ids = rng.permutation(len(phash)) * 7 + 3  # unique, out of order, not contiguous
    return Candidates(ids.astype(np.int64), np.array(content, dtype=CONTENT_DTYPE), np.array(phash, dtype=np.uint64))


def _chunks(candidates: Candidates, count: int) -> list[Candidates]:
    return [Candidates(*(column[part] for column in candidates))
            for part in np.array_split(np.arange(len(candidates.ids)), count)]


def _as_dict(decisions) -> dict[int, tuple[int, int]]:
    return {i: (r, d) for i, r, d in zip(decisions.ids.tolist(), decisions.reasons.tolist(),
                                         decisions.duplicate_of.tolist())}


@pytest.mark.parametrize("max_distance", [0, 4, 6])
@pytest.mark.parametrize("rows_per_partition", [40, 100_000])
def test_partitioned_decisions_equal_the_sequential_ones(max_distance, rows_per_partition):
    candidates = hashes_with_duplicates(max_distance, 600, max_distance)
    expected = sequential_decisions(candidates, max_distance)
    assert {reason for reason, _ in expected.values()} == {EXACT, PERCEPTUAL}

    pieces = deduplicate(LocalRunner(), _chunks(candidates, 3), candidates=len(candidates.ids),
                         max_distance=max_distance, rows_per_partition=rows_per_partition)

    assert partition_count(len(candidates.ids), rows_per_partition) >= (1 if rows_per_partition > 1000 else 25)
    assert _as_dict(merge_decisions(*pieces[0])) == expected


def test_decisions_are_cut_at_the_bounds():
    candidates = hashes_with_duplicates(1, 200, 4)
    bounds = np.array([700, 1400])
    ranges = deduplicate(LocalRunner(), [candidates], candidates=len(candidates.ids), max_distance=4,
                         rows_per_partition=50, bounds=bounds)
    merged = [merge_decisions(*pieces) for pieces in ranges]
    assert len(merged) == 3
    assert merged[0].ids.max() < 700 <= merged[1].ids.min() and merged[1].ids.max() < 1400 <= merged[2].ids.min()
    together = {**_as_dict(merged[0]), **_as_dict(merged[1]), **_as_dict(merged[2])}
    assert together == sequential_decisions(candidates, 4)


def test_a_chain_keeps_every_other_link():
    # 0 ~ 1 ~ 2 ~ 3 (each within 4 bits of the next, 8 bits from the one after): 1 repeats 0, 2 is kept, 3 repeats 2
    values = [0, 0b1111, 0b11111111, 0b111111111111]
    candidates = Candidates(np.arange(4, dtype=np.int64), np.array([f"{i:032x}" for i in range(4)], dtype=CONTENT_DTYPE),
                            np.array(values, dtype=np.uint64))
    pieces = deduplicate(LocalRunner(), [candidates], candidates=4, max_distance=4, rows_per_partition=1)
    assert _as_dict(merge_decisions(*pieces[0])) == {1: (PERCEPTUAL, 0), 3: (PERCEPTUAL, 2)}
