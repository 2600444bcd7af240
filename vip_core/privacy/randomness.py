"""Random streams of training runs: Poisson draws, Gaussian noise and per-sample randomness (MAE masks,
augmentation).

A private run's streams must not be searchable. torch's CPU generator keeps only the low 32 bits of the
seed it is given (``manual_seed(s)`` and ``manual_seed(s + 2**32)`` give the same stream), so no private
stream goes through it. Every stream here is a :class:`RandomStream` that answers the three questions a
run asks (which examples, how much noise, which mask) from one of two sources:

* ``"default"``: numpy's PCG64DXSM keyed by a 128-bit :class:`numpy.random.SeedSequence` spawned per ``(rank,
  purpose)`` from the run's root entropy. A private run's root entropy is 128 bits of OS entropy
  (:func:`private_entropy`), drawn afresh by every run: an attacker who knows the configuration still has
  2^128 keys to search. Gaussian noise is drawn as a :class:`GaussianDraw`: each draw takes a fresh 128-bit
  key from the stream, and each block of ``NOISE_BLOCK`` coordinates of each tensor comes from its own AES-128
  keystream (counter mode, OpenSSL through the ``cryptography`` package, about 1 ns per 64-bit word with
  AES-NI, three times PCG64DXSM's speed) whose key is AES-128 under the draw key of ``(tensor index, block)``
  (a pseudorandom function: one block's key tells nothing of another's or of the draw key), so the blocks can
  be drawn on several threads, in any order, and still give the same values. The CPU sampler is Box-Muller in
  float32 on a 63-bit word (radius) and a 24-bit one (angle) per pair, vectorised: about 2.3 ns per coordinate
  on one CPU core, a quarter of numpy's float32 ziggurat's time, with a longer tail (9.4 standard deviations
  against 8.2). On a CUDA device each tensor's noise is drawn on the device by two Philox generators keyed by
  ``(draw key, tensor index)`` (a 64-bit seed and a 62-bit offset each) and averaged (``(z₁ + z₂)/√2``).
  PCG64DXSM, which draws the keys, the Poisson samples and the per-sample randomness, is fast but not a
  cryptographic generator: its output is predictable to someone who sees enough of it raw, which a DP
  adversary never does (they see noisy sums). Someone who could predict the noise stream would know the draw
  keys and hence the noise; short of that, the AES keystream shows nothing of its key or of other blocks'
  noise.
* ``"secure"`` (``privacy.secure_mode``, in the spirit of opacus's secure_mode): every draw comes from the
  operating system's cryptographic generator (``os.urandom``, ChaCha20 in Linux), and each Gaussian
  coordinate is the sum of four independent draws divided by two (Holohan and Braghin, 2021), which
  closes the floating-point attack on a naively sampled Gaussian. It holds no state: a resumed run draws
  fresh randomness. It costs CPU time (see ``vip bench dp-step``'s ``dp_secure_ratio``).

A public run (the synthetic stage, evaluation) keys the same streams with its config seed, so it is
deterministic for a given config.

Poisson sampling compares 64-bit integers with ``floor(q · 2^64)``: each example is included with
probability in ``(q − 2^-64, q]``, never above the ``q`` the accountant is fed.
"""

from __future__ import annotations

import functools
import math
import os
import queue
import secrets
from fractions import Fraction
from typing import Any, Literal

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes

Mode = Literal["default", "secure"]
MODES: tuple[str, ...] = ("default", "secure")
PURPOSES = ("sampling", "noise", "sample")  # ``sample``: per-sample randomness (masks, augmentation)
ENTROPY_BITS = 128
_TWO_64 = 1 << 64
_CHUNK = 1 << 22  # Poisson draws per chunk: bounds the memory of one step's draw over a large data set
_SECURE_SUMMANDS = 4  # Holohan and Braghin: the sum of 4 N(0, 1/4) draws
NOISE_BLOCK = 1 << 20  # Gaussian coordinates per independently keyed generator of a GaussianDraw
_DEVICE_CHUNK = 1 << 24  # coordinates per call of a device draw's second generator: 64 MiB of transient memory
# Box-Muller pairs per vectorised chunk of a noise block (fixed: it orders the draws). Large enough that the
# helper threads seldom contend for the GIL between numpy calls (2^14 scaled 1.2x on two threads, 2^16 1.75x; in
# ViP-Base's step on two threads 2^18 drew the noise in 0.201 s against 2^16's 0.222 s).
_PAIRS_PER_CHUNK = 1 << 18
_WORDS = np.dtype("<u8")  # keystream words are read little-endian on every platform
_LOW_63 = np.uint64((1 << 63) - 1)
_LOW_24 = np.uint32((1 << 24) - 1)
_MIN_STD, _MAX_STD = 2.0**-100, 2.0**100  # a noise std outside would underflow or overflow somewhere in float32


def private_entropy() -> int:
    """128 bits of OS entropy: the root key of a private run."""
    return secrets.randbits(ENTROPY_BITS)


class RandomStream:
    """One independent stream of a run.

    Args:
        entropy: the run's root entropy (:func:`private_entropy` for a private run; the config seed for
            a public one).
        rank: the worker's global rank.
        purpose: one of ``PURPOSES``.
        mode: ``"default"`` (PCG64DXSM from a 128-bit key) or ``"secure"`` (the OS CSPRNG).
    """

    def __init__(self, entropy: int, rank: int, purpose: str, mode: Mode = "default") -> None:
        if purpose not in PURPOSES:
            raise ValueError(f"unknown random stream {purpose!r} (known: {', '.join(PURPOSES)})")
        if mode not in MODES:
            raise ValueError(f"random mode must be one of {', '.join(MODES)}, got {mode!r}")
        if entropy < 0:
            raise ValueError(f"entropy must be >= 0, got {entropy}")
        self.mode = mode
        self.purpose = purpose
        sequence = np.random.SeedSequence(entropy, spawn_key=(rank, PURPOSES.index(purpose)))
        self._numpy = np.random.Generator(np.random.PCG64DXSM(sequence)) if mode == "default" else None

    # ------------------------------------------------------------------------------------------- draws

    def bits(self, count: int) -> np.ndarray:
        """``[count]`` uniform uint64."""
        if self._numpy is None:
            return _urandom_bits(count)
        return self._numpy.integers(0, _TWO_64, size=count, dtype=np.uint64, endpoint=False)

    def uniform(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Uniform float32 in [0, 1) of ``shape`` (53-bit draws rounded down to float32)."""
        count = math.prod(shape)
        unit = (self.bits(count) >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [count] in [0, 1)
        return torch.from_numpy(unit.astype(np.float32).reshape(shape)).clamp_(max=1.0 - 2.0**-24)

    def poisson_indices(self, population: int, sample_rate: float) -> torch.Tensor:
        """The indices ``[k]`` (sorted int64) of a Poisson sample of ``range(population)``: each index is kept
        with probability ``floor(q · 2^64) / 2^64``, within 2^-64 below ``q`` and never above it."""
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}")
        threshold = inclusion_threshold(sample_rate)
        kept = []
        for start in range(0, population, _CHUNK):
            count = min(_CHUNK, population - start)
            draws = self.bits(count)  # draws: [count] uint64
            hits = np.nonzero(draws < np.uint64(threshold))[0] if threshold < _TWO_64 else np.arange(count)
            kept.append(hits + start)
        indices = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
        return torch.from_numpy(indices.astype(np.int64))

    def normal(self, shape: tuple[int, ...] | torch.Size, std: float, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
        """N(0, std²) of ``shape``, drawn in float32 and cast to ``dtype`` on ``device`` (one :class:`GaussianDraw`)."""
        return GaussianDraw(self, std).tensor(0, tuple(shape), dtype=dtype, device=torch.device(device))

    def draw_key(self) -> int | None:
        """128 fresh bits of this stream (None in secure mode, whose every draw is fresh CSPRNG output)."""
        if self._numpy is None:
            return None
        high, low = (int(v) for v in self.bits(2))
        return (high << 64) | low

    # ------------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: the PCG state (a secure stream has none; it draws afresh)."""
        state: dict[str, Any] = {"mode": self.mode, "purpose": self.purpose}
        if self._numpy is not None:
            pcg = self._numpy.bit_generator.state
            state.update(state=str(pcg["state"]["state"]), inc=str(pcg["state"]["inc"]),
                         has_uint32=int(pcg["has_uint32"]), uinteger=int(pcg["uinteger"]))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues the stream saved by :meth:`state_dict`; mode and purpose must match."""
        if (state.get("mode"), state.get("purpose")) != (self.mode, self.purpose):
            raise ValueError(f"random stream state is for {state.get('purpose')!r} in mode {state.get('mode')!r}, "
                             f"not {self.purpose!r} in mode {self.mode!r}")
        if self._numpy is not None:
            self._numpy.bit_generator.state = {
                "bit_generator": "PCG64DXSM",
                "state": {"state": int(state["state"]), "inc": int(state["inc"])},
                "has_uint32": int(state["has_uint32"]), "uinteger": int(state["uinteger"]),
            }


class GaussianDraw:
    """One draw of N(0, std²) noise for a fixed list of tensors (a step's noise), whose values do not depend on
    the order or the thread in which they are drawn.

    Default mode: the draw takes a 128-bit key from ``stream``; block ``b`` (``NOISE_BLOCK`` coordinates) of
    tensor ``i`` is drawn (Box-Muller, :func:`_box_muller_fill`) from the AES-128-CTR keystream whose key is
    ``AES-128_key(i ‖ b)`` (:meth:`keystream`), and on a CUDA device tensor ``i`` by two Philox generators keyed
    by ``SeedSequence(key, spawn_key=(i,))``. Secure mode:
    every block is fresh CSPRNG output (four Box-Muller draws summed and halved). The caller must give each
    tensor of the draw its own index and fill each block once.

    Args:
        stream: the noise stream (advanced by one key, 128 bits, in default mode).
        std: the standard deviation, in ``[2^-100, 2^100]`` (so that every float32 step of the sampler is exact
            to float32 rounding: no underflow to zero noise, no overflow).

    Raises:
        ValueError: for a standard deviation outside that range (or not a number).
    """

    def __init__(self, stream: RandomStream, std: float) -> None:
        if not _MIN_STD <= std <= _MAX_STD:
            raise ValueError(f"noise standard deviation {std!r} lies outside [2^-100, 2^100], where float32 noise "
                             "would underflow or overflow")
        self.std = std
        self.secure = stream.mode == "secure"
        self._key = stream.draw_key()

    @staticmethod
    def blocks(numel: int) -> range:
        """The block numbers of a tensor of ``numel`` coordinates."""
        return range((numel + NOISE_BLOCK - 1) // NOISE_BLOCK)

    @staticmethod
    def blocks_spanning(start: int, stop: int) -> range:
        """The block numbers holding coordinates ``start`` to ``stop - 1`` of a tensor (none when empty)."""
        if stop <= start:
            return range(0)
        return range(start // NOISE_BLOCK, (stop - 1) // NOISE_BLOCK + 1)

    def fill(self, index: int, out: torch.Tensor, block: int) -> None:
        """Writes block ``block`` of tensor ``index``'s noise into ``out`` (contiguous float32 on the CPU), in place."""
        if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("GaussianDraw.fill writes into a contiguous float32 CPU tensor")
        part = out.view(-1)[block * NOISE_BLOCK:(block + 1) * NOISE_BLOCK]  # part: [≤ NOISE_BLOCK]
        if self.secure:
            part.copy_(torch.from_numpy(_secure_normal(part.numel()))).mul_(self.std)
        else:
            _box_muller_fill(self.keystream(index, block), part.numpy(), self.std)

    def keystream(self, index: int, block: int) -> CipherContext:
        """The AES-128 counter-mode keystream (counter from 0) of block ``block`` of tensor ``index``, under the key
        ``AES-128_k(index ‖ block)`` (``k`` the draw key; index and block as little-endian 64-bit integers): a
        pseudorandom function, so every block has its own key and one block's key gives away no other."""
        if not (0 <= index < _TWO_64 and 0 <= block < _TWO_64):
            raise ValueError(f"tensor index {index} and block {block} must lie in [0, 2^64)")
        derive = Cipher(algorithms.AES(self._key.to_bytes(16, "little")), modes.ECB()).encryptor()
        key = derive.update(index.to_bytes(8, "little") + block.to_bytes(8, "little")) + derive.finalize()
        return Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()

    def tensor(self, index: int, shape: tuple[int, ...], *, dtype: torch.dtype = torch.float32,
               device: torch.device = torch.device("cpu")) -> torch.Tensor:
        """Tensor ``index``'s whole noise, of ``shape``, cast to ``dtype`` on ``device``."""
        noise = torch.empty(shape, dtype=torch.float32, device=device if self.on_device(device) else "cpu")
        self.fill_whole(index, noise)
        return noise.to(device=device, dtype=dtype)

    def on_device(self, device: torch.device) -> bool:
        """Whether noise for ``device`` is drawn there (CUDA, default mode) rather than on the CPU."""
        return device.type == "cuda" and not self.secure

    def fill_whole(self, index: int, out: torch.Tensor) -> None:
        """Writes tensor ``index``'s whole noise into ``out`` (contiguous float32): on the device where
        :meth:`on_device`, else block by block on the CPU (copied to ``out``'s device)."""
        if self.on_device(out.device):
            self._cuda_fill(index, out)
            return
        host = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=torch.float32)
        for block in self.blocks(out.numel()):
            self.fill(index, host, block)
        if host is not out:
            out.copy_(host)

    def _cuda_fill(self, index: int, out: torch.Tensor) -> None:
        """The mean of two device Philox draws, each keyed by a 64-bit seed and a 62-bit offset of this tensor; the
        second is added ``_DEVICE_CHUNK`` coordinates at a time, so that no second buffer of ``out``'s size is made."""
        words = np.random.SeedSequence(self._key, spawn_key=(index,)).generate_state(4, dtype=np.uint64)
        first, second = (_philox(int(words[k]), int(words[k + 1]), out.device) for k in (0, 2))
        flat = out.view(-1).normal_(generator=first)  # [numel]
        for start in range(0, flat.numel(), _DEVICE_CHUNK):
            part = flat[start:start + _DEVICE_CHUNK]
            part.add_(torch.randn(part.shape, generator=second, device=out.device, dtype=torch.float32))
        flat.mul_(self.std / math.sqrt(2.0))


def _philox(seed: int, offset: int, device: torch.device) -> torch.Generator:
    """A device generator seeded with ``seed`` (64 bits) at ``offset`` (62 bits; Philox offsets are multiples of 4)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    generator.set_offset((offset >> 2) << 2)
    return generator


class _Scratch:
    """One helper's working memory for a chunk of :func:`_box_muller_fill` (about 5 MB), kept between steps so
    that drawing the noise allocates nothing (a fresh buffer would cost a page fault every 4 KiB)."""

    def __init__(self) -> None:
        self.words = np.empty(_chunk_words(_PAIRS_PER_CHUNK), dtype=_WORDS)  # words: [P + ⌈P/2⌉], masked in place
        self.radius = np.empty(_PAIRS_PER_CHUNK, dtype=np.float32)  # radius: [P]
        self.angle = np.empty(_PAIRS_PER_CHUNK, dtype=np.float32)  # angle: [P]


def _chunk_words(pairs: int) -> int:
    """The keystream words a chunk of ``pairs`` pairs takes: one per radius (63 bits), half a one per angle (24)."""
    return pairs + (pairs + 1) // 2


@functools.cache
def _zeros(words: int) -> memoryview:
    """The plaintext of ``words`` keystream words, one buffer shared by every helper (read only): AES-CTR of zeros
    is the keystream."""
    return memoryview(bytes(8 * words))


_SCRATCH: queue.SimpleQueue[_Scratch] = queue.SimpleQueue()  # idle scratch, one per helper that ever ran


def _box_muller_fill(keystream: CipherContext, out: np.ndarray, std: float) -> None:
    """Fills ``out`` (1-D float32) with N(0, std²) by Box-Muller in float32, ``_PAIRS_PER_CHUNK`` pairs at a time
    (a fixed chunking, so the values depend only on the keystream): a chunk of ``P`` pairs takes ``P + ⌈P/2⌉``
    little-endian 64-bit words of ``keystream``; pair ``j``'s radius is ``√(−2 ln u₁)`` with
    ``u₁ = (63 low bits of word j + ½) · 2^-63`` rounded to float32, in ``(0, 1]`` (24 significant bits, but as small
    as 2^-64: the largest radius, 9.4, has probability 2^-63), and its angle is ``2π k / 2^24`` with ``k`` the 24 low
    bits of the ``j``-th 32-bit half word after the ``P`` radius words; the pair is ``std · radius · (cos, sin)(angle)``,
    the cosines first in the chunk, then the sines."""
    try:
        scratch = _SCRATCH.get_nowait()
    except queue.Empty:
        scratch = _Scratch()
    try:
        for start in range(0, out.size, 2 * _PAIRS_PER_CHUNK):
            _box_muller_chunk(keystream, out[start:start + 2 * _PAIRS_PER_CHUNK], std, scratch)
    finally:
        _SCRATCH.put(scratch)


def _box_muller_chunk(keystream: CipherContext, part: np.ndarray, std: float, scratch: _Scratch) -> None:
    """One chunk of :func:`_box_muller_fill`: ``part`` is ``[≤ 2P]`` float32, written in place."""
    pairs = (part.size + 1) // 2
    count = _chunk_words(pairs)
    written = keystream.update_into(_zeros(scratch.words.size)[:8 * count], scratch.words.view(np.uint8)[:8 * count])
    if written != 8 * count:
        raise RuntimeError(f"the AES keystream gave {written} bytes where {8 * count} were asked")
    words = scratch.words[:count]  # words: [pairs + ⌈pairs/2⌉]
    radius, angle = scratch.radius[:pairs], scratch.angle[:pairs]  # [pairs] each
    radius_words = np.bitwise_and(words[:pairs], _LOW_63, out=words[:pairs])
    np.copyto(radius, radius_words.view(np.int64), casting="unsafe")  # 63 bits, rounded to float32
    radius *= np.float32(2.0**-63)
    radius += np.float32(2.0**-64)  # u₁ in (0, 1]
    np.log(radius, out=radius)
    radius *= np.float32(-2.0)
    np.sqrt(radius, out=radius)
    radius *= np.float32(std)  # std · √(−2 ln u₁), std applied last (std² could underflow or overflow)
    half_words = words[pairs:].view(np.dtype("<u4"))[:pairs]
    np.bitwise_and(half_words, _LOW_24, out=half_words)
    np.copyto(angle, half_words.view(np.int32), casting="unsafe")  # 24 bits: exact
    angle *= np.float32(2.0 * math.pi * 2.0**-24)
    sines = part[pairs:]  # [part.size - pairs]
    np.sin(angle[:sines.size], out=sines)
    sines *= radius[:sines.size]
    np.cos(angle, out=angle)
    np.multiply(angle, radius, out=part[:pairs])


def _secure_normal(count: int) -> np.ndarray:
    """``[count]`` float32 N(0, 1): Box-Muller on 53-bit CSPRNG uniforms, four draws summed and halved."""
    total = np.zeros(count, dtype=np.float64)
    pairs = (count + 1) // 2
    for _ in range(_SECURE_SUMMANDS):
        u1 = ((_urandom_bits(pairs) >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]
        u2 = (_urandom_bits(pairs) >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
        radius = np.sqrt(-2.0 * np.log(u1))
        angle = 2.0 * np.pi * u2
        total += np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]
    return (total / math.sqrt(_SECURE_SUMMANDS)).astype(np.float32)


def _urandom_bits(count: int) -> np.ndarray:
    """``[count]`` uniform uint64 from the OS CSPRNG."""
    return np.frombuffer(os.urandom(8 * count), dtype=np.uint64).copy()


def inclusion_threshold(sample_rate: float) -> int:
    """``floor(q · 2^64)`` computed exactly: a uint64 draw below it has probability within 2^-64 below q."""
    return math.floor(Fraction(sample_rate) * _TWO_64)
