"""The old home of :mod:`tasks.runtime.tracking`, kept while ``tasks/pretrain.py`` and ``tasks/audit.py`` (and
their tests) import it from here; it goes when those modules move to ``tasks/stages/``."""

from tasks.runtime.tracking import *  # noqa: F401,F403
