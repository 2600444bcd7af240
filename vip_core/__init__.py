"""vip: differentially private foundation models for computer vision.

The core library. It imports no orchestration framework (Prefect, Ray, MLflow, img2dataset):
those live in ``tasks`` and ``flows``.
"""

import warnings

__version__ = "0.1.0"

# PIL warns while decoding some crafted images (palette transparency, a decompression bomb under the error limit):
# printed to a worker's log only when such an image is sampled, which a null sample never is, the warning would
# tell that it was. Process-wide, since image decoding runs on threads and catching warnings is not thread-safe.
warnings.filterwarnings("ignore", module=r"PIL(\.|$)")
