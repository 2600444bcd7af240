"""Contact sheets: many small images tiled on one page, to look at what a render produced."""

from __future__ import annotations

import numpy as np


def contact_sheet(images: list[np.ndarray], columns: int = 8, gap: int = 2) -> np.ndarray:
    """Images of one size ([H, W, 3] uint8) tiled in rows of ``columns`` on a white ground: [H', W', 3]."""
    if not images:
        raise ValueError("a contact sheet needs at least one image")
    height, width, _ = images[0].shape
    rows = -(-len(images) // columns)
    sheet = np.full((rows * (height + gap) + gap, columns * (width + gap) + gap, 3), 255, dtype=np.uint8)
    for index, image in enumerate(images):
        top = gap + (index // columns) * (height + gap)
        left = gap + (index % columns) * (width + gap)
        sheet[top : top + height, left : left + width] = image
    return sheet
