"""vip: differentially private foundation models for computer vision.

The core library. It imports no orchestration framework (Prefect, Ray, MLflow, img2dataset):
those live in ``tasks`` and ``flows``.
"""

__version__ = "0.1.0"
