"""The linear probe's features on disk: written once per worker's block, read back by any rows across the shards as
the encoder gave them (rounded to bfloat16), kept when whole; a probe trained from them is the one trained on the
same features in memory."""

from __future__ import annotations

import pytest
import torch

from tasks.fixtures.eval_sets import make_digits_imagefolder
from vip_core.config import tiny
from vip_core.eval import feature_store
from vip_core.eval.datasets import open_classification
from vip_core.eval.feature_store import InMemoryFeatures, StoredFeatures, stored_rounding, write_features
from vip_core.eval.features import extract_features
from vip_core.eval.linprobe import ProbeSettings, train_probe
from vip_core.eval.loading import Loading
from vip_core.models import build_encoder

LOADING = Loading(torch.device("cpu"))
OPTIONS = dict(last_blocks=2, batch_size=16, loading=LOADING)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    make_digits_imagefolder(root, img_size=32, per_class=6)
    torch.manual_seed(0)
    return open_classification(root).split("train", 32), build_encoder(tiny().model)


def _written_by(world: int, monkeypatch, train, encoder, folder) -> StoredFeatures:
    """The shards ``world`` workers write (each its block), read back as one split."""
    for rank in range(world):
        monkeypatch.setattr(feature_store, "rank_and_world", lambda rank=rank: (rank, world))
        monkeypatch.setattr("vip_core.eval.loading.rank_and_world", lambda rank=rank: (rank, world))
        write_features(encoder, train, folder, "train", **OPTIONS)
    monkeypatch.undo()
    return StoredFeatures(folder, "train")


def test_any_rows_read_back_across_the_shards_are_the_encoders_features_in_bfloat16(digits, tmp_path, monkeypatch):
    train, encoder = digits
    features, labels = extract_features(encoder, train, **OPTIONS)  # [50, 128]
    stored = _written_by(3, monkeypatch, train, encoder, tmp_path)
    assert len(list(tmp_path.glob("train-*-of-00003.bin"))) == 3
    assert (len(stored), stored.dim) == (50, 128) and torch.equal(stored.labels, labels)
    rows = torch.tensor([49, 15, 16, 17, 0, 32, 33, 5, 5])  # runs crossing shard ends (16, 33), and a row twice
    assert torch.equal(stored.rows(rows).float(), stored_rounding(features[rows]))
    assert torch.allclose(stored.rows(rows).float(), features[rows], rtol=2**-8, atol=1e-6)


def test_a_whole_shard_is_kept_when_the_job_starts_again(digits, tmp_path):
    train, encoder = digits
    write_features(encoder, train, tmp_path, "train", **OPTIONS)
    shard = next(tmp_path.glob("train-*.bin"))
    written = shard.stat().st_mtime_ns
    with torch.no_grad():
        for param in encoder.parameters():
            param.add_(1.0)  # another encoder would give other rows
    try:
        again = write_features(encoder, train, tmp_path, "train", **OPTIONS)
    finally:
        with torch.no_grad():
            for param in encoder.parameters():
                param.sub_(1.0)
    assert shard.stat().st_mtime_ns == written and len(again) == len(train)


def test_the_probe_read_from_disk_is_the_probe_trained_in_memory(digits, tmp_path):
    train, encoder = digits
    features, labels = extract_features(encoder, train, **OPTIONS)
    stored = write_features(encoder, train, tmp_path, "train", **OPTIONS)
    settings = ProbeSettings(epochs=3, lr=0.1, batch_size=16, optimizer="sgd")
    from_disk = train_probe(stored, 10, settings)
    in_memory = train_probe(InMemoryFeatures(stored_rounding(features), labels), 10, settings)
    for a, b in zip(from_disk.state_dict().values(), in_memory.state_dict().values()):
        assert torch.equal(a, b)
