"""Stages of the pipeline: each task does the I/O and framework work around ``vip_core``."""
