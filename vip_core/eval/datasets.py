"""Evaluation datasets on disk: ImageFolder classification, COCO detection, ADE20K segmentation.

Layouts:

- classification: ``root/train/<class>/<image>`` and ``root/val/<class>/<image>`` (``validation`` or
  ``test`` also name the held-out split). Class indices come from the training split's sorted folder
  names; a held-out class unknown to the training split is an error.
- COCO: ``root/annotations/instances_{train,val}2017.json`` with ``root/{train,val}2017/`` images.
- ADE20K: ``root/images/{training,validation}/*.jpg`` and ``root/annotations/{training,validation}/*.png``
  (``root`` may also be the folder holding ``ADEChallengeData2016``). Label 0 is "other" and ignored;
  labels 1..K become classes 0..K-1.

Every problem with the data is raised as one line naming the path: ``FileNotFoundError`` for a
missing path, ``ValueError`` for a malformed file.

Items are read by index or by an ``(index, epoch)`` key (:mod:`vip_core.eval.loading`). A training image's
augmentation draws from :data:`Draws` of its key: for public jobs a generator of the image's own, keyed by the job's
seed, the epoch and the index (:func:`keyed_draws`), so the draws are the same whichever decoding process or worker
reads it and wherever a resumed run restarts; for DP fine-tuning the private run's stream (:func:`stream_draws`).
A JPEG is decoded at the smallest scale that still covers what the transform needs (PIL's ``draft``): a 500 px
ImageNet photograph for a 224 px model decodes at half size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2 as T

from vip_core.eval.seeding import generator, seeded

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}
HELD_OUT_SPLITS = ("val", "validation", "test")
IGNORE_LABEL = 255


def require_dir(path: Path, what: str) -> Path:
    """``path`` if it is a folder, else a one-line ``FileNotFoundError`` naming ``what``."""
    if not path.is_dir():
        raise FileNotFoundError(f"{what} not found: {path}")
    return path


def require_file(path: Path, what: str) -> Path:
    """``path`` if it is a file, else a one-line ``FileNotFoundError`` naming ``what``."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    return path


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def load_rgb(path: Path, draft: int | None = None) -> Image.Image:
    """The image at ``path`` as RGB; an unreadable file is a one-line ``ValueError``.

    ``draft``: a JPEG is decoded at the smallest DCT scale (1/2, 1/4, 1/8) whose shorter side is still at least
    this many pixels; other formats decode whole.
    """
    try:
        with Image.open(path) as image:
            if draft is not None:
                image.draft("RGB", (draft, draft))
            return image.convert("RGB")
    except (OSError, SyntaxError) as error:
        raise ValueError(f"unreadable image {path}: {error}") from None


# ----------------------------------------------------------------------------------------- classification


Uniform = Callable[[tuple[int, ...]], torch.Tensor]
"""Uniform draws in [0, 1) of a shape: where an augmentation takes its randomness (:func:`uniform_from`, or a
private run's ``RandomStream.uniform``), never torch's global generator."""


Draws = Callable[[tuple[int, int]], Uniform]
"""Where the augmentation of the image with key ``(index, epoch)`` draws from."""


def uniform_from(generator: torch.Generator) -> Uniform:
    """Uniform draws from ``generator``."""
    return lambda shape: torch.rand(shape, generator=generator)


def keyed_draws(seed: int, name: str) -> Draws:
    """Each image's own draws in each epoch, keyed by the job's ``seed``, ``name``, the epoch and the index."""
    return lambda key: uniform_from(generator(seed, name, str(key[1]), str(key[0])))


def stream_draws(uniform: Uniform) -> Draws:
    """Every image's draws from one stream (a private run's), in the order the images are read."""
    return lambda key: uniform


def item_key(key: int | tuple[int, int]) -> tuple[int, int]:
    """``(index, epoch)`` of an item key; a bare index is epoch 0."""
    return (int(key[0]), int(key[1])) if isinstance(key, tuple) else (int(key), 0)


class RandomCropFlip:
    """torchvision's random resized crop (half to all of the area, aspect 3/4 to 4/3; the whole image after
    10 misses) to ``size`` × ``size``, then a horizontal flip with probability 1/2, drawn from ``uniform``."""

    SCALE = (0.5, 1.0)
    LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))
    TRIES = 10

    def __init__(self, size: int, uniform: Uniform) -> None:
        self.size = size
        self.uniform = uniform

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        top, left, height, width = self.box(*image.shape[-2:])
        image = T.functional.resized_crop(image, top, left, height, width, [self.size, self.size], antialias=True)
        return T.functional.horizontal_flip(image) if self.uniform((1,)).item() < 0.5 else image

    def box(self, height: int, width: int) -> tuple[int, int, int, int]:
        """``(top, left, height, width)`` of the crop."""
        for _ in range(self.TRIES):
            scale, ratio, row, column = self.uniform((4,)).tolist()
            area = height * width * (self.SCALE[0] + scale * (self.SCALE[1] - self.SCALE[0]))
            aspect = math.exp(self.LOG_RATIO[0] + ratio * (self.LOG_RATIO[1] - self.LOG_RATIO[0]))
            crop_width, crop_height = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < crop_width <= width and 0 < crop_height <= height:
                return (int(row * (height - crop_height + 1)), int(column * (width - crop_width + 1)),
                        crop_height, crop_width)
        return 0, 0, height, width


class DrawnRandAugment:
    """torchvision's ``RandAugment`` (``OPS`` operations per image at ``magnitude`` of 10, filled with the mean
    pixel), its draws for each image made by torch's generator seeded from ``uniform`` for that image alone
    (under :func:`~vip_core.eval.seeding.seeded`, so no other job draws from it meanwhile)."""

    OPS = 2
    BINS = 11  # magnitudes 0..10, as timm's ``rand-m9`` counts them

    def __init__(self, magnitude: int, uniform: Uniform) -> None:
        if not 0 < magnitude < self.BINS:
            raise ValueError(f"evaluation.finetune_randaugment: magnitude must be in 1..{self.BINS - 1}, got {magnitude}")
        fill = [round(255 * mean) for mean in IMAGENET_MEAN]
        self.transform = T.RandAugment(num_ops=self.OPS, magnitude=magnitude, num_magnitude_bins=self.BINS,
                                       interpolation=T.InterpolationMode.BILINEAR, fill=fill)
        self.uniform = uniform

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        high, low = (self.uniform((2,)) * 2**24).long().tolist()  # float32 uniforms carry 24 bits each
        with seeded(high << 24 | low):  # 48 bits; torch's generator keeps the low 32
            return self.transform(image)  # [3, S, S] uint8


def classification_transform(img_size: int, augment: Uniform | None = None,
                             randaugment: int = 0) -> Callable[[Image.Image], torch.Tensor]:
    """:class:`RandomCropFlip` drawing from ``augment`` (then :class:`DrawnRandAugment` at magnitude
    ``randaugment`` when it is not 0), or without it resize and centre crop: uint8 ``[3, S, S]``, normalised where
    it is used (:func:`vip_core.train.data.normalise`, on the job's device): a quarter of the bytes to move, and
    no float work in the decoding processes."""
    if augment is not None:
        geometry = [RandomCropFlip(img_size, augment)]
        geometry += [DrawnRandAugment(randaugment, augment)] if randaugment else []
    else:
        geometry = [T.Resize(img_size, antialias=True), T.CenterCrop(img_size)]
    return T.Compose([T.ToImage(), *geometry])


def draft_side(img_size: int, augmented: bool) -> int:
    """The shorter side a JPEG must keep when decoded for ``img_size``: more under :class:`RandomCropFlip`, whose
    smallest crop (half the area) is then still at least ``img_size`` pixels wide."""
    return math.ceil(img_size / math.sqrt(RandomCropFlip.SCALE[0])) if augmented else img_size


class ImageFolderDataset(Dataset):
    """(image, label) pairs from ``split/<class>/<image>`` with a given class-to-index map, as ``img_size`` px
    uint8 tensors: augmented with draws from ``draws`` (random crops and flips, RandAugment at ``randaugment`` when it is
    not 0), or resized and centre-cropped without them."""

    def __init__(self, split_dir: Path, class_to_idx: dict[str, int], img_size: int, draws: Draws | None = None,
                 randaugment: int = 0) -> None:
        self.split_dir = require_dir(split_dir, "image folder split")
        self.class_to_idx = class_to_idx
        self.img_size, self.draws, self.randaugment = img_size, draws, randaugment
        self.draft = draft_side(img_size, augmented=draws is not None)
        self.plain = classification_transform(img_size) if draws is None else None
        self.samples: list[tuple[Path, int]] = []
        for class_dir in sorted(p for p in split_dir.iterdir() if p.is_dir()):
            if class_dir.name not in class_to_idx:
                raise ValueError(f"class folder {class_dir} is not a class of the training split")
            self.samples += [(path, class_to_idx[class_dir.name]) for path in _image_files(class_dir)]
        if not self.samples:
            raise ValueError(f"no images in {split_dir} (expected {split_dir}/<class>/<image>)")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, _ = key = item_key(key)
        path, label = self.samples[index]
        transform = self.plain if self.plain is not None else classification_transform(
            self.img_size, self.draws(key), self.randaugment)
        return transform(load_rgb(path, self.draft)), label

    @property
    def labels(self) -> torch.Tensor:
        return torch.tensor([label for _, label in self.samples])


@dataclass(frozen=True)
class ClassificationData:
    """The two splits of an ImageFolder dataset and its class names."""

    root: Path
    train_dir: Path
    val_dir: Path
    classes: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def split(self, name: str, img_size: int, draws: Draws | None = None, randaugment: int = 0) -> ImageFolderDataset:
        """``name`` is ``train`` or ``val``; ``draws``: random crops and flips drawn from them, and RandAugment at
        magnitude ``randaugment`` (0: none)."""
        folder = self.train_dir if name == "train" else self.val_dir
        class_to_idx = {name: index for index, name in enumerate(self.classes)}
        return ImageFolderDataset(folder, class_to_idx, img_size, draws, randaugment)


def open_classification(root: str | Path) -> ClassificationData:
    """Checks an ImageFolder-layout dataset and returns its splits."""
    root = require_dir(Path(root), "dataset folder")
    train_dir = require_dir(root / "train", "training split (train/)")
    val_dir = next((root / name for name in HELD_OUT_SPLITS if (root / name).is_dir()), None)
    if val_dir is None:
        raise FileNotFoundError(f"held-out split not found: {root}/val (or validation/, test/)")
    classes = tuple(sorted(p.name for p in train_dir.iterdir() if p.is_dir()))
    if len(classes) < 2:
        raise ValueError(f"{train_dir} has {len(classes)} class folders; a classifier needs at least 2")
    return ClassificationData(root=root, train_dir=train_dir, val_dir=val_dir, classes=classes)


# -------------------------------------------------------------------------------------------------- COCO

COCO_SPLITS = {"train": "train2017", "val": "val2017"}


def coco_paths(root: str | Path, split: str) -> tuple[Path, Path]:
    """(annotation json, image folder) of ``split`` in a COCO-layout folder."""
    root = require_dir(Path(root), "dataset folder")
    name = COCO_SPLITS[split]
    annotations = require_file(root / "annotations" / f"instances_{name}.json", f"COCO {split} annotations")
    return annotations, require_dir(root / name, f"COCO {split} images")


def read_coco_json(path: Path) -> dict[str, Any]:
    """The parsed annotation file, checked for the fields detection needs."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"malformed COCO annotation file {path}: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"malformed COCO annotation file {path}: top level is not an object")
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise ValueError(f"malformed COCO annotation file {path}: no list '{key}'")
    _check_coco_entries(path, data)
    return data


def _check_coco_entries(path: Path, data: dict[str, Any]) -> None:
    needs = {"images": ("id", "file_name", "width", "height"), "categories": ("id",),
             "annotations": ("id", "image_id", "category_id", "bbox")}
    for key, fields in needs.items():
        for index, entry in enumerate(data[key]):
            missing = [f for f in fields if not isinstance(entry, dict) or f not in entry]
            if missing:
                raise ValueError(f"malformed COCO annotation file {path}: {key}[{index}] lacks {missing}")
    image_ids = {image["id"] for image in data["images"]}
    category_ids = {category["id"] for category in data["categories"]}
    for index, ann in enumerate(data["annotations"]):
        if ann["image_id"] not in image_ids or ann["category_id"] not in category_ids:
            raise ValueError(f"malformed COCO annotation file {path}: annotations[{index}] names an unknown "
                             "image or category")
        if not (isinstance(ann["bbox"], list) and len(ann["bbox"]) == 4):
            raise ValueError(f"malformed COCO annotation file {path}: annotations[{index}].bbox is not [x, y, w, h]")


def coco_has_masks(data: dict[str, Any]) -> bool:
    """Whether every annotation carries a segmentation (polygons or RLE)."""
    return bool(data["annotations"]) and all(ann.get("segmentation") for ann in data["annotations"])


class CocoDetectionDataset(Dataset):
    """COCO images resized to ``size`` × ``size`` with torchvision detection targets in that frame.

    Boxes become ``[x0, y0, x1, y1]`` scaled to the square; masks are rasterised and resized (nearest).
    Category ids map to labels 1..K in id order (0 is the background class of torchvision's detectors).
    """

    def __init__(self, data: dict[str, Any], image_dir: Path, size: int, with_masks: bool) -> None:
        from pycocotools import mask as mask_utils

        self._mask_utils = mask_utils
        self.images = sorted(data["images"], key=lambda image: image["id"])
        self.image_dir = image_dir
        self.size = size
        self.with_masks = with_masks
        self.category_ids = sorted(category["id"] for category in data["categories"])
        self.label_of = {category_id: index + 1 for index, category_id in enumerate(self.category_ids)}
        self.annotations: dict[int, list[dict[str, Any]]] = {image["id"]: [] for image in self.images}
        for ann in data["annotations"]:
            if not ann.get("iscrowd", 0):
                self.annotations[ann["image_id"]].append(ann)
        for image in self.images:
            require_file(image_dir / image["file_name"], "COCO image")

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        info = self.images[item_key(key)[0]]
        picture = load_rgb(self.image_dir / info["file_name"], self.size).resize((self.size, self.size), Image.BILINEAR)
        image = torch.from_numpy(np.array(picture)).permute(2, 0, 1).float() / 255  # [3, S, S]
        return image, self._target(info)

    def _target(self, info: dict[str, Any]) -> dict[str, torch.Tensor]:
        sx, sy = self.size / info["width"], self.size / info["height"]
        boxes, labels, masks = [], [], []
        for ann in self.annotations[info["id"]]:
            x, y, w, h = ann["bbox"]
            box = [x * sx, y * sy, (x + w) * sx, (y + h) * sy]
            if box[2] - box[0] < 1 or box[3] - box[1] < 1:
                continue
            boxes.append(box)
            labels.append(self.label_of[ann["category_id"]])
            if self.with_masks:
                masks.append(self._mask(ann, info))
        target = {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),  # [K, 4]
                  "labels": torch.tensor(labels, dtype=torch.int64)}  # [K]
        if self.with_masks:
            target["masks"] = (torch.stack(masks) if masks else
                               torch.zeros(0, self.size, self.size, dtype=torch.uint8))  # [K, S, S]
        return target

    def _mask(self, ann: dict[str, Any], info: dict[str, Any]) -> torch.Tensor:
        height, width = info["height"], info["width"]
        segmentation = ann["segmentation"]
        if isinstance(segmentation, list):
            rle = self._mask_utils.merge(self._mask_utils.frPyObjects(segmentation, height, width))
        elif isinstance(segmentation.get("counts"), list):
            rle = self._mask_utils.frPyObjects(segmentation, height, width)
        else:
            rle = segmentation
        full = Image.fromarray(self._mask_utils.decode(rle) * 255)  # [H, W]
        small = np.asarray(full.resize((self.size, self.size), Image.NEAREST)) > 127
        return torch.from_numpy(small.astype(np.uint8))  # [S, S]


def detection_collate(batch: list) -> tuple[list, list]:
    """Detection batches are lists: images may carry different numbers of objects."""
    images, targets = zip(*batch)
    return list(images), list(targets)


# ------------------------------------------------------------------------------------------------ ADE20K

ADE_SPLITS = {"train": "training", "val": "validation"}


def ade20k_root(root: str | Path) -> Path:
    """The folder holding ``images/`` and ``annotations/`` (``root`` or ``root/ADEChallengeData2016``)."""
    root = require_dir(Path(root), "dataset folder")
    nested = root / "ADEChallengeData2016"
    return nested if nested.is_dir() and not (root / "images").is_dir() else root


def ade20k_pairs(root: Path, split: str) -> list[tuple[Path, Path]]:
    """(image, label png) pairs of ``split``; an image without its label png is an error."""
    name = ADE_SPLITS[split]
    image_dir = require_dir(root / "images" / name, f"ADE20K {split} images")
    label_dir = require_dir(root / "annotations" / name, f"ADE20K {split} annotations")
    pairs = []
    for image in _image_files(image_dir):
        label = label_dir / f"{image.stem}.png"
        pairs.append((image, require_file(label, "ADE20K annotation")))
    if not pairs:
        raise ValueError(f"no images in {image_dir}")
    return pairs


def read_label_map(path: Path, num_classes: int) -> np.ndarray:
    """The label png as class indices 0..K-1, with ADE20K's 0 ("other") as :data:`IGNORE_LABEL`."""
    try:
        with Image.open(path) as picture:
            raw = np.asarray(picture)
    except OSError as error:
        raise ValueError(f"unreadable ADE20K annotation {path}: {error}") from None
    if raw.ndim != 2:
        raise ValueError(f"malformed ADE20K annotation {path}: expected a single-channel label png")
    if int(raw.max(initial=0)) > num_classes:
        raise ValueError(f"malformed ADE20K annotation {path}: label {int(raw.max())} exceeds {num_classes} classes")
    labels = raw.astype(np.int64) - 1  # [H, W]
    labels[raw == 0] = IGNORE_LABEL
    return labels


class SegmentationDataset(Dataset):
    """ADE20K pairs: the image resized to ``size`` × ``size`` and its label map.

    Training items (``draws`` given) carry the label map resized (nearest) to the square, both flipped
    horizontally with probability 1/2 drawn from ``draws`` of the item's key; evaluation items (``draws`` None)
    keep the label map at its original size, so mIoU is measured at full resolution.
    """

    def __init__(self, pairs: list[tuple[Path, Path]], size: int, num_classes: int,
                 draws: Draws | None = None) -> None:
        self.pairs = pairs
        self.size = size
        self.num_classes = num_classes
        self.draws = draws
        self.normalize = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        image_path, label_path = self.pairs[item_key(key)[0]]
        picture = load_rgb(image_path, self.size).resize((self.size, self.size), Image.BILINEAR)
        image = torch.from_numpy(np.array(picture)).permute(2, 0, 1).float() / 255  # [3, S, S]
        labels = read_label_map(label_path, self.num_classes)  # [H, W]
        if self.draws is not None:
            resized = Image.fromarray(labels.astype(np.uint8)).resize((self.size, self.size), Image.NEAREST)
            labels = np.asarray(resized).astype(np.int64)  # [S, S]
            if self.draws(item_key(key))((1,)).item() < 0.5:
                image, labels = image.flip(-1), labels[:, ::-1].copy()
        return self.normalize(image), torch.from_numpy(labels)


def segmentation_collate(batch: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Images stack; label maps stay a list (evaluation keeps each at its own size)."""
    images, labels = zip(*batch)
    return torch.stack(images), list(labels)
