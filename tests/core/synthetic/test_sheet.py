"""The contact sheet: images tiled on a grid with gaps."""

from __future__ import annotations

import numpy as np

from vip_core.synthetic.sheet import contact_sheet


def test_contact_sheet_tiles_images():
    tiles = [np.full((8, 8, 3), i * 20, dtype=np.uint8) for i in range(10)]
    sheet = contact_sheet(tiles, columns=4, gap=2)
    assert sheet.shape == (3 * 10 + 2, 4 * 10 + 2, 3)
    assert np.all(sheet[2:10, 12:20] == 20)
