"""Prefect flows: the end-to-end ViP pipeline and one flow per stage. They only compose ``tasks/``."""
