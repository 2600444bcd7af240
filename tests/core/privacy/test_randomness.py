"""Random streams: keyed by 128 bits (not 32), independent per rank and purpose, fresh per private run,
resumable, a secure mode from the OS CSPRNG, and a device path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from concurrent.futures import ThreadPoolExecutor

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from vip_core.privacy import randomness
from vip_core.privacy.randomness import ENTROPY_BITS, GaussianDraw, RandomStream, private_entropy

PURPOSES = ("sampling", "noise", "sample")


def first_draws(stream: RandomStream) -> list[float]:
    return stream.normal((16,), 1.0).tolist()


def test_torch_cpu_generators_keep_32_bits_of_their_seed_which_is_why_no_private_stream_uses_them():
    seed = 0x1234_5678_9ABC
    a = torch.normal(0.0, 1.0, (8,), generator=torch.Generator().manual_seed(seed))
    b = torch.normal(0.0, 1.0, (8,), generator=torch.Generator().manual_seed(seed + 2**32))
    assert torch.equal(a, b)


@pytest.mark.parametrize("bit", [32, 40, 63, 64, 100, 127])
@pytest.mark.parametrize("purpose", PURPOSES)
def test_seeds_that_differ_only_above_bit_32_give_different_streams(bit, purpose):
    seed = 0x0123_4567_89AB_CDEF_0123_4567_89AB_CDEF & ((1 << 128) - 1)
    a = RandomStream(seed, 0, purpose)
    b = RandomStream(seed ^ (1 << bit), 0, purpose)
    assert first_draws(a) != first_draws(b)
    assert a.bits(4).tolist() != b.bits(4).tolist()


def test_one_key_gives_one_stream_and_ranks_and_purposes_are_independent():
    seed = private_entropy()
    assert first_draws(RandomStream(seed, 3, "noise")) == first_draws(RandomStream(seed, 3, "noise"))
    streams = [RandomStream(seed, rank, purpose) for rank in range(3) for purpose in PURPOSES]
    coins = torch.stack([torch.from_numpy((s.bits(20_000) >> 63).astype("int64")) for s in streams]).double()
    agreement = (coins[:, None, :] == coins[None, :, :]).double().mean(-1)  # [S, S]
    off_diagonal = agreement[~torch.eye(len(streams), dtype=torch.bool)]
    # Independent fair coins agree half the time (std 0.0035); streams seeded alike would agree always.
    assert (off_diagonal - 0.5).abs().max() < 0.03


def test_private_entropy_is_128_fresh_bits():
    draws = {private_entropy() for _ in range(64)}
    assert len(draws) == 64 and ENTROPY_BITS == 128
    assert max(draws).bit_length() > 120


@pytest.mark.parametrize("mode", ["default", "secure"])
def test_gaussian_draws_have_the_asked_standard_deviation(mode):
    noise = RandomStream(7, 0, "noise", mode).normal((200_000,), 0.25, dtype=torch.float64)
    assert noise.dtype == torch.float64
    assert noise.std().item() == pytest.approx(0.25, rel=0.01)
    assert abs(noise.mean().item()) < 0.005
    # The tails of a Gaussian: about 4.6 % beyond two standard deviations.
    assert (noise.abs() > 0.5).double().mean().item() == pytest.approx(0.0455, rel=0.06)


@pytest.mark.parametrize("mode", ["default", "secure"])
def test_uniform_draws_lie_in_the_unit_interval_and_are_flat(mode):
    draws = RandomStream(1, 0, "sample", mode).uniform((400, 100))
    assert draws.shape == (400, 100) and draws.dtype == torch.float32
    assert 0.0 <= draws.min().item() and draws.max().item() < 1.0
    assert draws.mean().item() == pytest.approx(0.5, abs=0.005)
    assert draws.var().item() == pytest.approx(1 / 12, rel=0.02)


class KnownKeystream:
    """A keystream whose bytes are given (little-endian words): what a block's AES-128-CTR would supply."""

    def __init__(self, words):
        self.data = np.asarray(words, dtype="<u8").tobytes()
        self.used = 0

    def update_into(self, data, buf):
        count = len(data)
        assert not any(bytes(data)), "the plaintext of a keystream is zeros"
        buf[:count] = np.frombuffer(self.data[self.used:self.used + count], dtype=np.uint8)
        self.used += count
        return count


def box_muller_reference(words, count, pairs_per_chunk):
    """Box-Muller in float64 on the same words, chunk by chunk: radius from 63 bits (u₁ rounded to float32),
    angle from 24."""
    out, used = [], 0
    for start in range(0, count, 2 * pairs_per_chunk):
        size = min(2 * pairs_per_chunk, count - start)
        pairs = (size + 1) // 2
        radii = words[used:used + pairs]
        halves = words[used + pairs:used + pairs + (pairs + 1) // 2].view("<u4")[:pairs]
        used += pairs + (pairs + 1) // 2
        u1 = (radii & np.uint64((1 << 63) - 1)).astype(np.float32) * np.float32(2.0**-63) + np.float32(2.0**-64)
        u1 = u1.astype(np.float64)  # (63 bits + ½) · 2^-63, rounded to float32 as the sampler does
        radius = np.sqrt(-2.0 * np.log(u1))
        angle = 2 * np.pi * (halves & np.uint32((1 << 24) - 1)).astype(np.float64) * 2.0**-24
        out.append(np.concatenate([radius * np.cos(angle), (radius * np.sin(angle))[:size - pairs]]))
    return np.concatenate(out)


@pytest.mark.parametrize("count", [1, 7, 2 * randomness._PAIRS_PER_CHUNK + 5])
def test_default_gaussians_are_float32_box_muller_on_63_and_24_bit_uniforms(count):
    """The default sampler itself, on known words, chunking included; an all-zero word gives the largest
    radius, √(2 ln 2^64) = 9.42 standard deviations, beyond the float32 ziggurat's 8.2."""
    words = np.random.default_rng(0).integers(0, 2**64, size=2 * count + 8, dtype=np.uint64)
    words[0] = 0  # the first pair's radius word: u₁ = 2^-64
    words[(min(count, 2 * randomness._PAIRS_PER_CHUNK) + 1) // 2] = 0  # its angle: 0
    out = np.empty(count, dtype=np.float32)
    randomness._box_muller_fill(KnownKeystream(words), out, 0.5)
    expected = 0.5 * box_muller_reference(words, count, randomness._PAIRS_PER_CHUNK)
    assert np.allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert abs(out[0]) == pytest.approx(0.5 * math.sqrt(2 * 64 * math.log(2)), rel=1e-5)


def aes_keystream_words(draw: GaussianDraw, index: int, block: int, words: int) -> np.ndarray:
    """``words`` little-endian uint64 of AES-128-CTR (counter from 0) under ``AES-128_key(index ‖ block)``, computed
    here with ECB: the keystream's 16-byte block j is AES of the counter j (big-endian)."""
    derive = Cipher(algorithms.AES(draw._key.to_bytes(16, "little")), modes.ECB()).encryptor()
    key = derive.update(index.to_bytes(8, "little") + block.to_bytes(8, "little"))
    counters = b"".join(j.to_bytes(16, "big") for j in range((8 * words + 15) // 16))
    stream = Cipher(algorithms.AES(key), modes.ECB()).encryptor().update(counters)
    return np.frombuffer(stream[:8 * words], dtype="<u8")


def test_each_noise_block_is_box_muller_on_one_aes_128_ctr_keystream_keyed_by_the_draw_the_tensor_and_the_block():
    """A whole block (several chunks) and a short last block, against Box-Muller on one contiguous keystream
    under the documented key: a keystream restarted per chunk, or keyed otherwise, fails."""
    draw = GaussianDraw(RandomStream(5, 0, "noise"), 0.5)
    pairs = randomness._PAIRS_PER_CHUNK
    tail = 2 * pairs + 3  # the second block: a full chunk and a short one of 3 coordinates
    tensor = torch.full((randomness.NOISE_BLOCK + tail,), float("nan"))
    for block in (0, 1):
        draw.fill(7, tensor, block)
    for block, count in ((0, randomness.NOISE_BLOCK), (1, tail)):
        chunks = -(-count // (2 * pairs))
        words = chunks * (pairs + (pairs + 1) // 2)  # enough for every chunk (the short one takes fewer)
        expected = 0.5 * box_muller_reference(aes_keystream_words(draw, 7, block, words), count, pairs)
        got = tensor[block * randomness.NOISE_BLOCK:][:count].numpy()
        assert np.allclose(got, expected, rtol=1e-5, atol=1e-5), f"block {block}"
    first, second = tensor[:2 * pairs], tensor[2 * pairs:4 * pairs]
    assert (first == second).double().mean().item() < 1e-3  # no chunk repeats another's draws


@pytest.mark.parametrize("std", [2.0**-100, 1e-20, 2.0**100])
@pytest.mark.parametrize("flush_denormal", [False, True])
def test_the_noise_has_its_standard_deviation_at_the_ends_of_the_accepted_range(std, flush_denormal):
    previous = torch.set_flush_denormal(flush_denormal)
    try:
        noise = RandomStream(3, 0, "noise").normal((100_000,), std, dtype=torch.float64)
    finally:
        torch.set_flush_denormal(False)
    assert previous is not None and noise.isfinite().all()
    assert (noise == 0).double().mean().item() < 1e-4
    assert (noise.std() / std).item() == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize("std", [0.0, 2.0**-101, 2.0**101, float("inf"), float("nan")])
def test_a_noise_standard_deviation_that_float32_cannot_carry_is_refused(std):
    with pytest.raises(ValueError, match="noise standard deviation"):
        GaussianDraw(RandomStream(3, 0, "noise"), std)


def test_secure_gaussians_are_four_box_muller_draws_from_the_csprng_summed_and_halved(monkeypatch):
    """The floating-point mitigation itself, on known CSPRNG bytes: N(0,1) = (z₁ + z₂ + z₃ + z₄) / 2."""
    source = np.random.default_rng(0)
    supplied = []

    def known_bytes(count: int) -> bytes:
        supplied.append(source.bytes(count))
        return supplied[-1]

    monkeypatch.setattr(randomness.os, "urandom", known_bytes)
    got = RandomStream(0, 0, "noise", "secure").normal((6,), 1.0, dtype=torch.float64)
    words = [np.frombuffer(chunk, dtype=np.uint64) for chunk in supplied]
    assert len(words) == 8  # four summands, two uniforms each
    expected = np.zeros(6)
    for u1_bits, u2_bits in zip(words[0::2], words[1::2]):
        u1 = ((u1_bits >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
        u2 = (u2_bits >> np.uint64(11)).astype(np.float64) * 2.0**-53
        radius = np.sqrt(-2.0 * np.log(u1))
        expected += np.concatenate([radius * np.cos(2 * np.pi * u2), radius * np.sin(2 * np.pi * u2)])
    assert np.allclose(got.numpy(), (expected / 2).astype(np.float32), rtol=1e-6)


def fill_all(draw: GaussianDraw, shapes: list[tuple[int, ...]], order: list[tuple[int, int]], pool=None) -> list:
    tensors = [torch.full(shape, float("nan")) for shape in shapes]
    jobs = [(index, tensors[index], block) for index, block in order]
    if pool is None:
        for job in jobs:
            draw.fill(*job)
    else:
        list(pool.map(lambda job: draw.fill(*job), jobs))
    return tensors


def test_a_gaussian_draw_gives_the_same_noise_in_any_order_on_any_thread_and_fresh_noise_per_block(monkeypatch):
    block = 2 * randomness._PAIRS_PER_CHUNK + 3  # two chunks a block, the second short: threads overlap in chunks
    monkeypatch.setattr(randomness, "NOISE_BLOCK", block)
    shapes = [(12, block), (block - 5,), (block + 7,)]  # 12, 1 and 2 blocks
    order = [(i, b) for i, shape in enumerate(shapes) for b in GaussianDraw.blocks(math.prod(shape))]
    assert len(order) == 15
    seed = private_entropy()
    in_order = fill_all(GaussianDraw(RandomStream(seed, 0, "noise"), 0.5), shapes, order)
    backwards = fill_all(GaussianDraw(RandomStream(seed, 0, "noise"), 0.5), shapes, order[::-1])
    with ThreadPoolExecutor(4) as pool:
        threaded = fill_all(GaussianDraw(RandomStream(seed, 0, "noise"), 0.5), shapes, order, pool)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(in_order, backwards, threaded))
    flat = torch.cat([t.flatten() for t in in_order])
    assert not flat.isnan().any() and flat.std().item() == pytest.approx(0.5, rel=0.01)
    blocks = [b[:100] for t in in_order for b in t.flatten().split(block)]
    assert len({tuple(b.tolist()) for b in blocks}) == len(blocks)  # no block repeats another's draws
    whole = GaussianDraw(RandomStream(seed, 0, "noise"), 0.5).tensor(2, (block + 7,))
    assert torch.equal(whole, in_order[2])


def test_each_gaussian_draw_takes_one_fresh_key_from_the_stream_and_a_resumed_stream_draws_the_same():
    stream = RandomStream(private_entropy(), 0, "noise")
    first = GaussianDraw(stream, 1.0).tensor(0, (64,))
    state = stream.state_dict()
    second = GaussianDraw(stream, 1.0).tensor(0, (64,))
    assert not torch.equal(first, second)
    resumed = RandomStream(private_entropy(), 0, "noise")
    resumed.load_state_dict(state)
    assert torch.equal(GaussianDraw(resumed, 1.0).tensor(0, (64,)), second)
    assert not torch.equal(GaussianDraw(stream, 1.0).tensor(1, (64,)), GaussianDraw(stream, 1.0).tensor(0, (64,)))


def test_a_gaussian_draw_fills_only_contiguous_float32_cpu_tensors():
    draw = GaussianDraw(RandomStream(1, 0, "noise"), 1.0)
    with pytest.raises(ValueError, match="contiguous float32 CPU"):
        draw.fill(0, torch.zeros(4, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="contiguous float32 CPU"):
        draw.fill(0, torch.zeros(4, 4).t(), 0)


def test_secure_mode_has_no_state_and_never_repeats_itself():
    a, b = RandomStream(1, 0, "noise", "secure"), RandomStream(1, 0, "noise", "secure")
    assert first_draws(a) != first_draws(b)  # the key is not used: every draw is the OS CSPRNG's
    assert set(a.state_dict()) == {"mode", "purpose"}


def test_a_saved_state_continues_the_stream():
    stream = RandomStream(private_entropy(), 1, "sample")
    stream.uniform((10,))
    state = stream.state_dict()
    expected = stream.uniform((5,))
    resumed = RandomStream(private_entropy(), 1, "sample")
    resumed.load_state_dict(state)
    assert torch.equal(resumed.uniform((5,)), expected)
    with pytest.raises(ValueError, match="'noise'"):
        RandomStream(0, 0, "noise").load_state_dict(state)


def test_unknown_purposes_and_modes_are_refused():
    with pytest.raises(ValueError, match="unknown random stream"):
        RandomStream(0, 0, "dropout")
    with pytest.raises(ValueError, match="random mode"):
        RandomStream(0, 0, "noise", "fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_noise_is_keyed_by_the_stream_and_has_the_asked_standard_deviation():
    device = torch.device("cuda")
    seed = private_entropy()
    a = RandomStream(seed, 0, "noise").normal((1_000_000,), 0.5, device=device)
    b = RandomStream(seed, 0, "noise").normal((1_000_000,), 0.5, device=device)
    c = RandomStream(seed ^ (1 << 100), 0, "noise").normal((1_000_000,), 0.5, device=device)
    assert a.device.type == "cuda" and torch.equal(a, b) and not torch.equal(a, c)
    assert a.std().item() == pytest.approx(0.5, rel=0.01) and math.isfinite(a.sum().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_draw_larger_than_a_chunk_is_keyed_and_has_the_asked_standard_deviation():
    """Past ``_DEVICE_CHUNK`` the second generator is added chunk by chunk: still deterministic, still N(0, std²)
    throughout (the last chunk included), no chunk a copy of another."""
    device, chunk = torch.device("cuda"), randomness._DEVICE_CHUNK
    seed = private_entropy()
    a = RandomStream(seed, 0, "noise").normal((2 * chunk + 1000,), 0.5, device=device)
    b = RandomStream(seed, 0, "noise").normal((2 * chunk + 1000,), 0.5, device=device)
    assert torch.equal(a, b)
    for part in (a[:chunk], a[chunk:2 * chunk], a[2 * chunk:]):
        assert part.std().item() == pytest.approx(0.5, rel=0.05) and abs(part.mean().item()) < 0.05
    assert not torch.equal(a[:1000], a[chunk:chunk + 1000])
