"""The pipeline's stages, one module each: ``ingest``, ``render``, ``pretrain``, ``eval``, ``audit``. Each
re-runs idempotently: the work already in its output folder is kept."""
