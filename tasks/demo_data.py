"""Small evaluation datasets made offline, for the demo and the tests.

- :func:`make_digits_imagefolder`: scikit-learn's bundled 8x8 handwritten digits, upsampled to
  ``img_size`` RGB images in ImageFolder layout (``train/<digit>/``, ``val/<digit>/``, 80/20 per class).
- :func:`make_coco_shapes`: squares, discs and triangles of random colours on noisy backgrounds, with
  COCO-format boxes and polygon masks (``annotations/instances_{train,val}2017.json``, ``train2017/``, ``val2017/``).
- :func:`make_ade20k_shapes`: the same kind of scenes in ADE20K layout, with a label png per image
  (1 = background, 2 = square, 3 = disc, 4 = triangle; 0, "other", is unused).

Each builder is deterministic for a given seed, writes into ``root`` and returns a summary dict.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("square", "disc", "triangle")


def make_digits_imagefolder(root: str | Path, img_size: int, seed: int = 0, per_class: int | None = None) -> dict[str, Any]:
    """The 1,797 scikit-learn digits (or ``per_class`` of each digit) as ``img_size`` px RGB PNGs in
    ImageFolder layout."""
    from sklearn.datasets import load_digits

    root = Path(root)
    digits = load_digits()
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "val": 0}
    for label in range(10):
        members = rng.permutation(np.flatnonzero(digits.target == label))[:per_class]
        cut = int(round(0.8 * len(members)))
        for split, indices in (("train", members[:cut]), ("val", members[cut:])):
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            for index in indices:
                _digit_image(digits.images[index], img_size).save(folder / f"{index:04d}.png")
            counts[split] += len(indices)
    return {"root": str(root), "classes": 10, **counts}


def _digit_image(pixels: np.ndarray, img_size: int) -> Image.Image:
    gray = Image.fromarray((pixels * (255 / 16)).astype(np.uint8))  # [8, 8], values 0..16
    return gray.resize((img_size, img_size), Image.BICUBIC).convert("RGB")


def _shape_polygon(kind: str, cx: float, cy: float, radius: float) -> list[tuple[float, float]]:
    if kind == "square":
        return [(cx - radius, cy - radius), (cx + radius, cy - radius), (cx + radius, cy + radius), (cx - radius, cy + radius)]
    if kind == "triangle":
        return [(cx, cy - radius), (cx + radius, cy + radius), (cx - radius, cy + radius)]
    return [(cx + radius * math.cos(a), cy + radius * math.sin(a)) for a in np.linspace(0, 2 * math.pi, 24, endpoint=False)]


def _scene(img_size: int, rng: np.random.Generator) -> tuple[Image.Image, list[tuple[str, list[tuple[float, float]]]]]:
    """A noisy background with 1-3 non-overlapping shapes; returns the image and (kind, polygon) pairs."""
    base = rng.integers(0, 256, size=3)
    noise = rng.normal(0, 18, size=(img_size, img_size, 3))
    image = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    shapes, taken = [], []
    for _ in range(int(rng.integers(1, 4))):
        radius = float(rng.uniform(0.12, 0.22) * img_size)
        cx, cy = (float(v) for v in rng.uniform(radius + 1, img_size - radius - 1, size=2))
        if any(math.hypot(cx - x, cy - y) < radius + r + 2 for x, y, r in taken):
            continue
        taken.append((cx, cy, radius))
        kind = SHAPES[int(rng.integers(len(SHAPES)))]
        polygon = _shape_polygon(kind, cx, cy, radius)
        colour = tuple(int(c) for c in (255 - base + rng.integers(-40, 41, size=3)).clip(0, 255))
        draw.polygon(polygon, fill=colour)
        shapes.append((kind, polygon))
    return image, shapes


def _coco_annotation(ann_id: int, image_id: int, kind: str, polygon: list[tuple[float, float]]) -> dict[str, Any]:
    xs, ys = [p[0] for p in polygon], [p[1] for p in polygon]
    x0, y0 = min(xs), min(ys)
    area = 0.5 * abs(sum(xs[i] * ys[i - 1] - xs[i - 1] * ys[i] for i in range(len(polygon))))
    return {"id": ann_id, "image_id": image_id, "category_id": SHAPES.index(kind) + 1, "iscrowd": 0,
            "bbox": [x0, y0, max(xs) - x0, max(ys) - y0], "area": area,
            "segmentation": [[round(c, 2) for point in polygon for c in point]]}


def make_coco_shapes(root: str | Path, img_size: int, n: int, seed: int = 0) -> dict[str, Any]:
    """``n`` training and ``max(4, n // 4)`` validation scenes in COCO layout with boxes and masks."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    categories = [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(SHAPES)]
    summary: dict[str, Any] = {"root": str(root)}
    ann_id = 1
    for split, count in (("train", n), ("val", max(4, n // 4))):
        folder = root / f"{split}2017"
        folder.mkdir(exist_ok=True)
        images, annotations = [], []
        for index in range(count):
            image_id = index + 1
            image, shapes = _scene(img_size, rng)
            name = f"{image_id:012d}.jpg"
            image.save(folder / name, quality=95)
            images.append({"id": image_id, "file_name": name, "width": img_size, "height": img_size})
            for kind, polygon in shapes:
                annotations.append(_coco_annotation(ann_id, image_id, kind, polygon))
                ann_id += 1
        payload = {"images": images, "annotations": annotations, "categories": categories}
        (root / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(payload))
        summary[split] = {"images": count, "objects": len(annotations)}
    return summary


def make_ade20k_shapes(root: str | Path, img_size: int, n: int, seed: int = 0) -> dict[str, Any]:
    """``n`` training and ``max(4, n // 4)`` validation scenes in ADE20K layout with label pngs."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    summary: dict[str, Any] = {"root": str(root), "classes": 1 + len(SHAPES)}
    for split, name, count in (("train", "training", n), ("val", "validation", max(4, n // 4))):
        image_dir, label_dir = root / "images" / name, root / "annotations" / name
        image_dir.mkdir(parents=True, exist_ok=True)
        label_dir.mkdir(parents=True, exist_ok=True)
        for index in range(count):
            image, shapes = _scene(img_size, rng)
            labels = Image.new("L", (img_size, img_size), 1)
            draw = ImageDraw.Draw(labels)
            for kind, polygon in shapes:
                draw.polygon(polygon, fill=2 + SHAPES.index(kind))
            stem = f"ADE_{split}_{index + 1:08d}"
            image.save(image_dir / f"{stem}.jpg", quality=95)
            labels.save(label_dir / f"{stem}.png")
        summary[split] = {"images": count}
    return summary
