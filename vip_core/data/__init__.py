"""Datasets on disk: webdataset-format tar shards, image decoding and transforms."""
