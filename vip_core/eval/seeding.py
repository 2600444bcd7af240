"""The randomness of a public evaluation job: its own generators, whatever runs beside it.

torch keeps one global generator per process. Evaluation jobs run in parallel threads, so a
``torch.manual_seed`` in one job reseeded it for every job and their draws interleaved: the same config gave
other numbers from one run to the next. A job draws instead from generators of its own, keyed by the
config's seed and the job's name (:func:`job_seed`):

* ``torch.Generator`` objects (:func:`generator`) for its epochs' orders, each image's augmentation, its drop path
  and every ``DataLoader`` (:class:`vip_core.eval.loading.Loading`: one without a generator draws its workers'
  base seed from the global generator), and numpy generators (:func:`numpy_generator`) for its mixup and cutmix;
* for what can only draw from the global generator (a module's initialisation, torchvision's detection
  samplers and RandAugment), a block under :func:`seeded`: the global generator seeded for the block and restored after
  it, under one lock of the process, so no other job draws from it meanwhile.

Evaluation code draws from the global generator nowhere else, so a job's numbers are the same alone or
beside others. DP fine-tuning keeps a private run's fresh OS entropy for its sampling, noise,
augmentation and drop path (:mod:`vip_core.privacy.randomness`).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Iterator

import numpy as np
import torch

_GLOBAL_GENERATOR = threading.RLock()


def job_seed(seed: int, *names: str) -> int:
    """A 63-bit seed for ``names`` (the job, then what it seeds) under the config's ``seed``."""
    key = "/".join([str(seed), *names]).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def generator(seed: int, *names: str) -> torch.Generator:
    """A CPU generator seeded with :func:`job_seed` of ``seed`` and ``names``."""
    return torch.Generator().manual_seed(job_seed(seed, *names))


def numpy_generator(seed: int, *names: str) -> np.random.Generator:
    """A numpy generator seeded with :func:`job_seed` of ``seed`` and ``names`` (for Beta draws, which torch's
    generators do not offer)."""
    return np.random.default_rng(job_seed(seed, *names))


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Runs the block alone on torch's global generator (CPU and initialised CUDA devices), seeded with ``seed``."""
    devices = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
    with _GLOBAL_GENERATOR, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
