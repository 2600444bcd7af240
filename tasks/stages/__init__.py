"""The pipeline's stages, one module each: ``ingest``, ``render``, ``eval`` (and ``tasks/pretrain.py``,
``tasks/audit.py``). Each re-runs idempotently: the work already in its output folder is kept."""
