"""DP across workers, on two real gloo processes: noise once per logical step (total std σC), gradients
summed, identical parameters after every step, and a check that catches ranks that drift apart."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from vip_core.privacy.engine import privatized_gradients
from vip_core.privacy.randomness import RandomStream
from vip_core.train.distributed import (
    all_reduce_gradients,
    all_reduce_sum,
    check_parameters_equal,
    gather_objects,
    parameters_fingerprint,
    rank_noise_multiplier,
)

SIGMA, CLIP, EXPECTED_BATCH = 1.5, 0.5, 8.0
WORLD = 2


def _zero_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A per-sample loss whose gradient is zero: the privatized gradient is pure noise."""
    return (model(x) * 0.0).sum(dim=1)  # [B]


def _square_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean(dim=1)  # [B]


def _noise_std(rank: int) -> float:
    """The std of the summed gradient when every rank's clipped sum is zero."""
    model = nn.Linear(64, 1024)  # 66,560 parameters: the std estimate is within 0.5 %
    privatized_gradients(
        model, _zero_loss, torch.randn(4, 64), max_grad_norm=CLIP,
        noise_multiplier=rank_noise_multiplier(SIGMA, rank), expected_batch_size=EXPECTED_BATCH,
        noise=RandomStream(11, rank, "noise"),
    )
    all_reduce_gradients(model.parameters())
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return grads.std().item() * EXPECTED_BATCH


def _train_steps(rank: int, reduce: bool) -> list[str]:
    """Three private steps on rank-specific data; the parameter fingerprint on every rank after each."""
    torch.manual_seed(0)  # the same initial parameters on every rank
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = RandomStream(3, rank, "sample").normal((6, 8), 1.0)  # different per rank
    fingerprints = []
    for _ in range(3):
        privatized_gradients(
            model, _square_loss, data, max_grad_norm=CLIP, noise_multiplier=rank_noise_multiplier(SIGMA, rank),
            expected_batch_size=EXPECTED_BATCH, noise=RandomStream(5, rank, "noise"),
        )
        if reduce:
            all_reduce_gradients(model.parameters())
        optimizer.step()
        fingerprints.append(gather_objects(parameters_fingerprint(model)))
    try:
        check_parameters_equal(model)
        verdict = "equal"
    except RuntimeError as error:
        verdict = str(error)
    return [json.dumps(fingerprints), verdict]


def _worker(rank: int, init_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        outcome = {
            "noise_std": _noise_std(rank),
            "count": all_reduce_sum(rank + 1),
            "reduced": _train_steps(rank, reduce=True),
            "not_reduced": _train_steps(rank, reduce=False),
        }
        results[rank] = outcome
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Runs the checks on two gloo processes; returns each rank's outcome."""
    init_file = tmp_path_factory.mktemp("dist") / "init"
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(str(init_file), results), nprocs=WORLD, join=True)
        return dict(results)


def test_noise_is_added_once_per_step_total_std_sigma_c_for_two_workers(two_ranks):
    expected = SIGMA * CLIP
    for rank in range(WORLD):
        assert math.isclose(two_ranks[rank]["noise_std"], expected, rel_tol=0.02)
    # Noise added on both ranks would give sqrt(2) * sigma * C.
    assert abs(two_ranks[0]["noise_std"] - expected * math.sqrt(2)) > 0.3 * expected


def test_single_worker_noise_has_the_same_std():
    assert math.isclose(_noise_std(0), SIGMA * CLIP, rel_tol=0.02)


def test_ranks_agree_on_sums(two_ranks):
    assert two_ranks[0]["count"] == two_ranks[1]["count"] == 3.0


def test_parameters_are_identical_on_every_rank_after_every_step(two_ranks):
    fingerprints = json.loads(two_ranks[0]["reduced"][0])
    assert len(fingerprints) == 3
    for per_rank in fingerprints:
        assert per_rank[0] == per_rank[1]
    assert len({per_rank[0] for per_rank in fingerprints}) == 3  # the parameters did move
    assert two_ranks[0]["reduced"][1] == two_ranks[1]["reduced"][1] == "equal"


def test_check_catches_ranks_that_drift_apart(two_ranks):
    fingerprints = json.loads(two_ranks[0]["not_reduced"][0])
    assert fingerprints[0][0] != fingerprints[0][1]
    assert two_ranks[0]["not_reduced"][1] == "parameters of ranks [1] differ from rank 0's"
