"""How a job's data is dealt out: every worker an equal share of each global batch, the same number of steps, the
whole batch between them; the device a config names."""

from __future__ import annotations

import pytest
import torch

from vip_core.eval import loading
from vip_core.eval.loading import EpochBatches, resolve_device


def _shares(monkeypatch, world: int, size: int, batch_size: int, epoch: int, **options) -> list[list[list[tuple]]]:
    """Each rank's batches of ``epoch``, as the ranks of a world of ``world`` workers would draw them."""
    per_rank = []
    for rank in range(world):
        monkeypatch.setattr(loading, "rank_and_world", lambda rank=rank: (rank, world))
        sampler = EpochBatches(size, batch_size, seed=7, name="order", **options)
        per_rank.append(list(sampler.set_epoch(epoch)))
    return per_rank


def test_workers_take_equal_shares_of_the_one_process_batches(monkeypatch):
    (alone,) = _shares(monkeypatch, 1, 52, 8, epoch=3)
    ranks = _shares(monkeypatch, 4, 52, 8, epoch=3)
    assert len(alone) == 7 and all(len(batches) == 7 for batches in ranks)  # 52 = 6 x 8 + 4
    for step, batch in enumerate(alone):
        shares = [ranks[rank][step] for rank in range(4)]
        assert all(len(share) == len(batch) // 4 for share in shares)
        assert [key for share in shares for key in share] == batch
    assert {epoch for batch in alone for _, epoch in batch} == {3}
    assert [len(batches) for batches in _shares(monkeypatch, 4, 50, 8, epoch=3)] == [6] * 4  # 2 left: fewer than 4


def test_the_order_is_new_each_epoch_the_same_for_a_seed_and_kept_without_shuffling(monkeypatch):
    (first,), (again,), (later,) = (_shares(monkeypatch, 1, 40, 8, epoch=e) for e in (0, 0, 1))
    assert first == again and [i for b in first for i, _ in b] != [i for b in later for i, _ in b]
    (plain,) = _shares(monkeypatch, 1, 10, 4, epoch=0, shuffle=False)
    assert [[index for index, _ in batch] for batch in plain] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    (dropped,) = _shares(monkeypatch, 1, 10, 4, epoch=0, shuffle=False, drop_last=True)
    assert len(dropped) == 2


def test_a_batch_that_does_not_split_over_the_workers_is_refused(monkeypatch):
    monkeypatch.setattr(loading, "rank_and_world", lambda: (0, 3))
    with pytest.raises(ValueError, match="batch size 8 is not a multiple of the 3 workers"):
        EpochBatches(30, 8, seed=0, name="order")


def test_the_device_is_the_configs(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="evaluation.device: cuda, but torch finds no CUDA device"):
        resolve_device("cuda")
