"""Global deduplication in partitions: the same decisions as one sequential pass, with bounded memory per worker.

The rule (what one process deciding the candidates one by one in order decides): candidates are taken in
increasing ``id``; a candidate is *kept* unless it repeats a kept one, either ``exact`` (the same content
hash as a kept candidate) or ``perceptual`` (its perceptual hash within ``max_distance`` bits of a kept
one's), and then it names the earliest such kept candidate. Which copies are kept is the lexicographically
first maximal independent set of the "repeats" graph in id order.

The work is cut so that no step holds more than one partition (the caller's orchestration sends the pieces
between steps; every function here is pure and runs anywhere):

1. :func:`split_by_owner` sends every candidate to the *owner* partition of its perceptual hash.
2. :func:`group_twins`, per owner: candidates with an identical perceptual hash are *twins*; the first in id
   order is the *leader*, the others follow its fate (kept leader: they repeat it, ``exact`` when their content hash
   equals its; a leader that repeats K: they repeat K). Exact duplicates are twins, so only leaders, with
   distinct perceptual hashes, go on.
3. For each block key (:class:`~vip_core.data.dedup.BlockKeys`): :func:`split_by_key` sends each leader to
   the partition of its masked hash, and :func:`find_edges` compares the leaders sharing a masked value:
   every pair within ``max_distance`` becomes an *edge* (found under one key only), sent to the owner of its
   later end (which must learn its earlier neighbour's fate) and, as a subscription, to the owner of its earlier end.
4. Rounds of :func:`greedy_round` decide the leaders with edges, each owner its own: a leader is kept when
   every earlier neighbour was removed, and repeats its earliest neighbour that is kept once every earlier
   neighbour before that one was removed. Each round's decisions go to the subscribed owners. Rounds are
   needed as long as the longest chain of dependent decisions (a few for near-duplicate clusters).
5. :func:`decide`, per owner, gives every candidate's decision.

Memory per step is that of one partition (candidates, or leaders under one key, or edges); the number of
partitions grows with the number of candidates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Protocol, Sequence

import numpy as np

from vip_core.data.dedup import BlockKeys, expand_ranges, hamming_distances

logger = logging.getLogger(__name__)

KEPT, EXACT, PERCEPTUAL = 0, 1, 2
REASONS = {EXACT: "exact", PERCEPTUAL: "perceptual"}
UNDECIDED, REMOVED = -1, 2  # a greedy vertex's status: UNDECIDED, KEPT or REMOVED
CONTENT_DTYPE = np.dtype("S32")  # the first 32 hex digits (128 bits) of the sha256: equal contents, equal keys
_MIX = (np.uint64(30), np.uint64(0xBF58476D1CE4E5B9), np.uint64(27), np.uint64(0x94D049BB133111EB), np.uint64(31))
_MAX_PAIRS = 1 << 20  # pairs compared at once in find_edges (memory: about 60 MB)


class Candidates(NamedTuple):
    """Candidates for deduplication: ``ids`` ``[n]`` int64 (unique; the smaller comes first), ``content``
    ``[n]`` :data:`CONTENT_DTYPE`, ``phash`` ``[n]`` uint64."""

    ids: np.ndarray
    content: np.ndarray
    phash: np.ndarray


class Leaders(NamedTuple):
    """Leaders: ``ids`` ``[n]`` int64 and ``phash`` ``[n]`` uint64."""

    ids: np.ndarray
    phash: np.ndarray


@dataclass(frozen=True)
class Twins:
    """One owner's candidates grouped by perceptual hash. ``leaders``: the first of each hash (sorted by id);
    ``follower_ids`` ``[f]``, ``follower_leader`` ``[f]`` (the id of each one's leader) and ``same_content`` ``[f]``
    (bool: its content hash is its leader's)."""

    leaders: Leaders
    follower_ids: np.ndarray
    follower_leader: np.ndarray
    same_content: np.ndarray


class Edges(NamedTuple):
    """What one owner receives of the edges found under one key: ``later`` ``[e]`` and ``earlier`` ``[e]``, the
    edges whose later end it owns; ``subscribed`` ``[s]`` (ids it owns) and ``subscriber`` ``[s]`` (the owners that
    must hear their fate)."""

    later: np.ndarray
    earlier: np.ndarray
    subscribed: np.ndarray
    subscriber: np.ndarray


class Messages(NamedTuple):
    """Decisions sent to an owner: ``ids`` ``[m]`` and ``kept`` ``[m]`` (bool)."""

    ids: np.ndarray
    kept: np.ndarray


class Decisions(NamedTuple):
    """Every candidate that is not kept, sorted by id: ``ids`` ``[d]``, ``reasons`` ``[d]`` (:data:`EXACT` or
    :data:`PERCEPTUAL`) and ``duplicate_of`` ``[d]`` (the id of the kept candidate it repeats)."""

    ids: np.ndarray
    reasons: np.ndarray
    duplicate_of: np.ndarray


def partition_count(rows: int, rows_per_partition: int) -> int:
    """Partitions for ``rows`` rows of at most about ``rows_per_partition`` each (at least one)."""
    return max(1, -(-rows // rows_per_partition))


def partition_of(values: np.ndarray, partitions: int) -> np.ndarray:
    """The partition ``[n]`` of each uint64 value ``[n]``: the value mixed by splitmix64's finaliser (every bit of
    it moves every bit of the result: masked hashes, whose low bits are all zero, spread evenly too), modulo
    ``partitions``."""
    first_shift, first_factor, second_shift, second_factor, last_shift = _MIX
    mixed = values.astype(np.uint64)
    mixed = (mixed ^ (mixed >> first_shift)) * first_factor
    mixed = (mixed ^ (mixed >> second_shift)) * second_factor
    return ((mixed ^ (mixed >> last_shift)) % np.uint64(partitions)).astype(np.int64)


def _split(rows: NamedTuple, target: np.ndarray, partitions: int) -> list:
    """``rows`` (a NamedTuple of ``[n]`` arrays) cut into one NamedTuple per partition by ``target`` ``[n]``."""
    order = np.argsort(target, kind="stable")
    bounds = np.searchsorted(target[order], np.arange(partitions + 1))
    columns = [column[order] for column in rows]
    return [type(rows)(*(column[bounds[p]:bounds[p + 1]] for column in columns)) for p in range(partitions)]


def _concat(pieces: tuple, kind: type) -> NamedTuple:
    return kind(*(np.concatenate(column) for column in zip(*pieces))) if pieces else kind(*_empty(kind))


def _empty(kind: type) -> list[np.ndarray]:
    dtypes = {"content": CONTENT_DTYPE, "phash": np.uint64, "kept": bool}
    return [np.empty(0, dtypes.get(field, np.int64)) for field in kind._fields]


# ------------------------------------------------------------------------------------ owners and twins


def split_by_owner(candidates: Candidates, partitions: int) -> list[Candidates]:
    """Step 1: the candidates cut by the owner of their perceptual hash, one piece per owner."""
    return _split(candidates, partition_of(candidates.phash, partitions), partitions)


def group_twins(*pieces: Candidates) -> Twins:
    """Step 2: one owner's candidates (its pieces from every chunk) grouped by identical perceptual hash."""
    candidates = _concat(pieces, Candidates)
    order = np.argsort(candidates.phash)
    ids, content, phash = (column[order] for column in candidates)
    starts = np.flatnonzero(np.r_[True, phash[1:] != phash[:-1]]) if len(ids) else np.empty(0, np.int64)
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(ids)]))  # [n]: its group of twins
    first = ids == (np.minimum.reduceat(ids, starts) if len(ids) else ids)[group]  # [n]: leads its group
    leader_at = np.flatnonzero(first)[group]  # [n]: its leader's position
    by_id = np.argsort(ids[first])
    return Twins(
        leaders=Leaders(ids[first][by_id], phash[first][by_id]),
        follower_ids=ids[~first],
        follower_leader=ids[leader_at][~first],
        same_content=(content == content[leader_at])[~first],
    )


# ---------------------------------------------------------------------------------- near-duplicate edges


def split_by_key(twins: Twins, mask: int, partitions: int) -> list[Leaders]:
    """Step 3a: one owner's leaders cut by the partition of their hash under the key ``mask``."""
    leaders = twins.leaders
    return _split(leaders, partition_of(leaders.phash & np.uint64(mask), partitions), partitions)


def find_edges(*pieces: Leaders, keys: BlockKeys, key: int, owners: int) -> list[Edges]:
    """Step 3b: every pair of leaders within ``keys.max_distance`` first found under key number ``key`` among
    the leaders of one key partition (its pieces from every owner), cut by owner."""
    leaders = _concat(pieces, Leaders)
    mask = keys.masks[key]
    order = np.argsort(leaders.phash & mask)
    ids, phash = leaders.ids[order], leaders.phash[order]
    earlier, later = [], []  # positions of each edge's ends
    for first, second in _pairs_sharing(phash & mask):
        near = hamming_distances(phash[first], phash[second]) <= keys.max_distance
        first, second = first[near], second[near]
        once = keys.first_shared_mask(phash[first], phash[second]) == mask  # counted under one key only
        first, second = first[once], second[once]
        swap = ids[first] > ids[second]
        earlier.append(np.where(swap, second, first))
        later.append(np.where(swap, first, second))
    earlier, later = np.concatenate(earlier), np.concatenate(later)
    owner = partition_of(phash, owners)  # [n]
    incoming = _split(Pair(ids[later], ids[earlier]), owner[later], owners)
    outgoing = _split(Pair(ids[earlier], owner[later]), owner[earlier], owners)
    return [Edges(*into, *out) for into, out in zip(incoming, outgoing)]


class Pair(NamedTuple):
    first: np.ndarray
    second: np.ndarray


def _pairs_sharing(values: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every pair ``(i, j)``, i < j, of positions of equal values in the sorted ``values`` ``[n]``, in chunks of
    about :data:`_MAX_PAIRS` pairs at most (at least one chunk): ``([p], [p])`` int64 position arrays."""
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])  # [r]
    ends = np.r_[starts[1:], len(values)]
    partners = np.repeat(ends, ends - starts)[: len(values)] - np.arange(len(values)) - 1  # [n]: equal ones after it
    elements = np.flatnonzero(partners)
    window = (np.cumsum(partners[elements]) - 1) // _MAX_PAIRS  # [m]: the chunk each element's pairs end in
    for chunk in np.split(elements, np.flatnonzero(np.diff(window)) + 1):
        owner, second = expand_ranges(chunk + 1, partners[chunk])
        yield chunk[owner], second


# ------------------------------------------------------------------------------------------ greedy rounds


@dataclass(frozen=True)
class Greedy:
    """One owner's leaders with edges and what it knows of their neighbours.

    ``ids`` ``[v]`` (sorted), ``status`` ``[v]`` (UNDECIDED, KEPT or REMOVED), ``duplicate_of`` ``[v]``;
    ``edge_start`` ``[v + 1]``: leader x's earlier neighbours are ``earlier[edge_start[x]:edge_start[x + 1]]``
    (sorted), whose statuses as heard so far are ``heard`` ``[e]``; ``subscribed`` ``[s]`` (positions in ids)
    and ``subscriber`` ``[s]``: who must hear each leader's fate.
    """

    ids: np.ndarray
    status: np.ndarray
    duplicate_of: np.ndarray
    edge_start: np.ndarray
    earlier: np.ndarray
    heard: np.ndarray
    subscribed: np.ndarray
    subscriber: np.ndarray


def start_greedy(*pieces: Edges) -> Greedy:
    """Step 4a: one owner's leaders with edges, from its pieces of every key's edges; none decided."""
    edges = _concat(pieces, Edges)
    ids = np.union1d(edges.later, edges.subscribed)
    order = np.lexsort((edges.earlier, edges.later))
    later, earlier = edges.later[order], edges.earlier[order]
    subscriptions = np.unique(np.stack([np.searchsorted(ids, edges.subscribed), edges.subscriber]), axis=1)
    return Greedy(
        ids=ids,
        status=np.full(len(ids), UNDECIDED, dtype=np.int8),
        duplicate_of=np.full(len(ids), -1, dtype=np.int64),
        edge_start=np.searchsorted(later, np.r_[ids, np.iinfo(np.int64).max]),
        earlier=earlier,
        heard=np.full(len(earlier), UNDECIDED, dtype=np.int8),
        subscribed=subscriptions[0],
        subscriber=subscriptions[1],
    )


def greedy_round(greedy: Greedy, *inbox: Messages, owners: int) -> tuple:
    """Step 4b: one round for one owner: hears the decisions in ``inbox``, decides every leader it can.

    Returns:
        ``(greedy, undecided, *outbox)``: the new state, how many of its leaders are still undecided, and
        the decisions of this round for each of the ``owners`` (one :class:`Messages` each).
    """
    heard = _hear(greedy, _concat(inbox, Messages))
    status, duplicate_of = greedy.status.copy(), greedy.duplicate_of.copy()
    counts = np.diff(greedy.edge_start)  # [v]
    waiting = heard != REMOVED  # [e]: a neighbour that keeps a later one from being kept
    first = np.where(waiting, np.arange(len(heard)), len(heard))  # [e]
    has_edges = counts > 0
    first_waiting = np.full(len(counts), len(heard), dtype=np.int64)
    first_waiting[has_edges] = np.minimum.reduceat(first, greedy.edge_start[:-1][has_edges]) if len(heard) else []
    open_ = status == UNDECIDED
    free = open_ & (first_waiting >= greedy.edge_start[1:])  # every earlier neighbour removed
    blocked = open_ & ~free
    repeats = blocked.copy()
    repeats[blocked] = heard[first_waiting[blocked]] == KEPT
    status[free], status[repeats] = KEPT, REMOVED
    duplicate_of[repeats] = greedy.earlier[first_waiting[repeats]]
    decided = open_ & (status != UNDECIDED)
    state = Greedy(greedy.ids, status, duplicate_of, greedy.edge_start, greedy.earlier, heard,
                   greedy.subscribed, greedy.subscriber)
    return (state, int((status == UNDECIDED).sum()), *_outbox(state, decided, owners))


def _hear(greedy: Greedy, inbox: Messages) -> np.ndarray:
    """The neighbours' statuses ``[e]`` once the decisions in ``inbox`` are heard."""
    heard = greedy.heard.copy()
    order = np.argsort(inbox.ids)
    found, at = _find(inbox.ids[order], greedy.earlier)
    heard[found] = np.where(inbox.kept[order][at[found]], KEPT, REMOVED)
    return heard


def _find(sorted_ids: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(found [w] bool, position [w])`` of each wanted id in ``sorted_ids`` (position meaningful where found)."""
    at = np.minimum(np.searchsorted(sorted_ids, wanted), max(len(sorted_ids) - 1, 0))
    found = sorted_ids[at] == wanted if len(sorted_ids) else np.zeros(len(wanted), dtype=bool)
    return found, at


def _outbox(greedy: Greedy, decided: np.ndarray, owners: int) -> list[Messages]:
    """This round's decisions, one :class:`Messages` per subscribed owner."""
    send = decided[greedy.subscribed]  # [s]
    positions, targets = greedy.subscribed[send], greedy.subscriber[send]
    ids, kept = greedy.ids[positions], greedy.status[positions] == KEPT
    return [Messages(ids[targets == p], kept[targets == p]) for p in range(owners)]


# ---------------------------------------------------------------------------------------------- decisions


def decide(twins: Twins, greedy: Greedy) -> Decisions:
    """Step 5: the decisions of every candidate one owner holds (the kept ones left out)."""
    if (greedy.status == UNDECIDED).any():
        raise ValueError("decide() called before every leader with edges was decided")
    leaders = twins.leaders.ids
    with_edges, at = _find(greedy.ids, leaders)
    removed = np.zeros(len(leaders), dtype=bool)  # [l]
    removed[with_edges] = greedy.status[at[with_edges]] == REMOVED
    repeated = leaders.copy()  # [l]: the kept candidate each leader's group repeats
    repeated[removed] = greedy.duplicate_of[at[removed]]
    # a follower of a kept leader repeats it (exactly when their contents are equal); of a removed one, what it repeats
    leader = np.searchsorted(leaders, twins.follower_leader)  # [f]
    exact = ~removed[leader] & twins.same_content
    ids = np.r_[leaders[removed], twins.follower_ids]
    reasons = np.r_[np.full(removed.sum(), PERCEPTUAL), np.where(exact, EXACT, PERCEPTUAL)].astype(np.int8)
    duplicate_of = np.r_[repeated[removed], repeated[leader]].astype(np.int64)
    order = np.argsort(ids, kind="stable")
    return Decisions(ids[order], reasons[order], duplicate_of[order])


def split_by_id(decisions: Decisions, bounds: np.ndarray) -> list[Decisions]:
    """Decisions cut at the ids ``bounds`` ``[b]`` (sorted): ``b + 1`` pieces, ids below ``bounds[0]`` first."""
    return _split(decisions, np.searchsorted(bounds, decisions.ids, side="right"), len(bounds) + 1)


def merge_decisions(*pieces: Decisions) -> Decisions:
    """Pieces of decisions (of different owners) as one, sorted by id."""
    decisions = _concat(pieces, Decisions)
    order = np.argsort(decisions.ids, kind="stable")
    return Decisions(*(column[order] for column in decisions))


# ------------------------------------------------------------------------------------------ orchestration


class Runner(Protocol):
    """Where the steps run (``tasks.runtime.runner``: in this process, or as Ray tasks). A handle stands for a
    step's result and may be passed, as a positional argument, to the next step."""

    def submit(self, function: Callable, *args: Any, **kwargs: Any) -> Any: ...

    def submit_split(self, function: Callable, *args: Any, count: int, **kwargs: Any) -> list[Any]: ...

    def get(self, handles: Sequence[Any]) -> list[Any]: ...

    def wait(self, handles: Sequence[Any]) -> None: ...


def deduplicate(runner: Runner, chunks: Sequence[Any], *, candidates: int, max_distance: int,
                rows_per_partition: int, bounds: np.ndarray | None = None) -> list[list[Any]]:
    """Decides every candidate of ``chunks`` by the module's rule, in partitions of about ``rows_per_partition``.

    Args:
        runner: where the steps run.
        chunks: handles to :class:`Candidates` (ids unique across all of them).
        candidates: how many candidates the chunks hold together (sets the number of partitions).
        max_distance: the largest perceptual-hash distance of a near duplicate.
        rows_per_partition: candidates per partition, about (memory per step).
        bounds: ``[b]`` sorted ids at which to cut the decisions (for example where each shard block starts).

    Returns:
        For each of the ``b + 1`` id ranges, handles to the pieces (one per partition) of its :class:`Decisions`
        (:func:`merge_decisions` joins them).
    """
    bounds = np.empty(0, np.int64) if bounds is None else np.asarray(bounds, np.int64)
    owners = partition_count(candidates, rows_per_partition)
    keys = BlockKeys(max_distance)
    pieces = [runner.submit_split(split_by_owner, chunk, owners, count=owners) for chunk in chunks]
    twins = [runner.submit(group_twins, *(piece[owner] for piece in pieces)) for owner in range(owners)]
    edges = _find_all_edges(runner, twins, keys, owners)
    greedy = [runner.submit(start_greedy, *edges[owner]) for owner in range(owners)]
    greedy = _decide_in_rounds(runner, greedy, owners)
    ranges = len(bounds) + 1
    decided = [runner.submit_split(_decide_by_range, twins[owner], greedy[owner], bounds, count=ranges)
               for owner in range(owners)]
    return [[by_range[index] for by_range in decided] for index in range(ranges)]


def _find_all_edges(runner: Runner, twins: list[Any], keys: BlockKeys, owners: int) -> list[list[Any]]:
    """Each owner's pieces of the edges, found one key after another: a key's leaders are split while the last
    key's edges are found, and no more than those two keys' leaders are in flight."""
    edges: list[list[Any]] = [[] for _ in range(owners)]
    in_flight: list[Any] = []
    for key, mask in enumerate(keys.masks.tolist()):
        by_key = [runner.submit_split(split_by_key, owner_twins, mask, owners, count=owners) for owner_twins in twins]
        runner.wait(in_flight)
        found = [runner.submit_split(find_edges, *(piece[part] for piece in by_key), keys=keys, key=key,
                                     owners=owners, count=owners) for part in range(owners)]
        in_flight = [handle for handles in found for handle in handles]
        for owner in range(owners):
            edges[owner].extend(handles[owner] for handles in found)
    return edges


def _decide_in_rounds(runner: Runner, greedy: list[Any], owners: int) -> list[Any]:
    """Greedy rounds until every leader with edges is decided; each round decides at least the earliest
    undecided leader (all its earlier neighbours were decided before), so the count falls every round."""
    inbox: list[list[Any]] = [[] for _ in range(owners)]
    rounds, left = 0, None
    while True:
        results = [runner.submit_split(greedy_round, greedy[owner], *inbox[owner], owners=owners, count=owners + 2)
                   for owner in range(owners)]
        greedy = [result[0] for result in results]
        undecided = sum(runner.get([result[1] for result in results]))
        rounds += 1
        if undecided == 0:
            logger.info("deduplication decided in %d partitions and %d greedy rounds", owners, rounds)
            return greedy
        if undecided == left:
            raise RuntimeError(f"deduplication made no progress in round {rounds} ({undecided} undecided)")
        left = undecided
        inbox = [[result[2 + owner] for result in results] for owner in range(owners)]


def _decide_by_range(twins: Twins, greedy: Greedy, bounds: np.ndarray) -> list[Decisions]:
    return split_by_id(decide(twins, greedy), bounds)
