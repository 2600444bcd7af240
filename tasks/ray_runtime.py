"""The old home of :mod:`tasks.runtime.ray_session`, kept while ``tasks/pretrain.py`` (and its tests) import it
from here; it goes when that module moves to ``tasks/stages/``."""

from tasks.runtime.ray_session import ray_session  # noqa: F401
