"""Evaluation datasets: the offline builders' layouts load, and bad data fails with one line naming it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.fixtures.eval_sets import make_ade20k_shapes, make_coco_shapes, make_digits_imagefolder
from vip_core.eval.datasets import (
    IGNORE_LABEL, CocoDetectionDataset, DrawnRandAugment, SegmentationDataset, ade20k_pairs, ade20k_root,
    classification_transform, keyed_draws, open_classification, read_coco_json, read_label_map, uniform_from,
)
from vip_core.eval.detection import open_coco


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco")
    make_coco_shapes(root, img_size=48, n=8)
    return root


def test_digits_imagefolder_has_ten_classes_in_both_splits_at_the_requested_size(tmp_path):
    summary = make_digits_imagefolder(tmp_path, img_size=24, per_class=10)
    data = open_classification(tmp_path)
    train, val = data.split("train", 24), data.split("val", 24)
    assert data.num_classes == 10 and summary["train"] == len(train) == 80 and summary["val"] == len(val) == 20
    image, label = val[0]
    assert image.shape == (3, 24, 24) and 0 <= label < 10
    assert sorted(set(train.labels.tolist())) == list(range(10))


def test_missing_dataset_or_split_is_one_line_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset folder not found"):
        open_classification(tmp_path / "nowhere")
    (tmp_path / "train" / "a").mkdir(parents=True)
    (tmp_path / "train" / "b").mkdir()
    with pytest.raises(FileNotFoundError, match="held-out split not found") as error:
        open_classification(tmp_path)
    assert "\n" not in str(error.value)


def test_held_out_class_unknown_to_training_split_is_refused(tmp_path):
    make_digits_imagefolder(tmp_path, img_size=16, per_class=5)
    (tmp_path / "val" / "eleven").mkdir()
    data = open_classification(tmp_path)
    with pytest.raises(ValueError, match="not a class of the training split"):
        data.split("val", 16)


def test_coco_shapes_boxes_and_masks_agree_after_resizing(coco_root):
    splits = open_coco(coco_root)
    assert splits["with_masks"]
    dataset = CocoDetectionDataset(splits["train"]["data"], splits["train"]["images"], size=96, with_masks=True)
    image, target = dataset[0]
    assert image.shape == (3, 96, 96) and float(image.max()) <= 1.0
    assert len(target["boxes"]) == len(target["labels"]) == len(target["masks"]) >= 1
    for box, mask in zip(target["boxes"], target["masks"]):
        ys, xs = torch.nonzero(mask, as_tuple=True)
        # the mask's extent matches the box (scaled 48 -> 96 px) to within a couple of pixels
        assert abs(xs.min() - box[0]) <= 3 and abs(ys.min() - box[1]) <= 3
        assert abs(xs.max() + 1 - box[2]) <= 3 and abs(ys.max() + 1 - box[3]) <= 3


@pytest.mark.parametrize("content, problem", [
    ("{not json", "malformed COCO annotation file"),
    (json.dumps({"images": [], "categories": []}), "no list 'annotations'"),
    (json.dumps({"images": [{"id": 1, "file_name": "a.jpg", "width": 4, "height": 4}], "categories": [{"id": 1}],
                 "annotations": [{"id": 1, "image_id": 1, "category_id": 7, "bbox": [0, 0, 1, 1]}]}),
     "unknown image or category"),
    (json.dumps({"images": [{"id": 1}], "categories": [], "annotations": []}), "images\\[0\\] lacks"),
])
def test_malformed_coco_annotations_are_one_line_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "instances_train2017.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=problem) as error:
        read_coco_json(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_ade20k_layout_maps_label_zero_to_ignore_and_shifts_classes(tmp_path):
    make_ade20k_shapes(tmp_path, img_size=32, n=4)
    pairs = ade20k_pairs(ade20k_root(tmp_path), "train")
    assert len(pairs) == 4
    raw = np.asarray(Image.open(pairs[0][1]))
    labels = read_label_map(pairs[0][1], num_classes=4)
    assert set(np.unique(raw)) <= {1, 2, 3, 4} and np.array_equal(labels, raw.astype(np.int64) - 1)
    image, resized = SegmentationDataset(pairs, size=64, num_classes=4, draws=keyed_draws(0, "flips"))[0]
    assert image.shape == (3, 64, 64) and resized.shape == (64, 64)
    zero = tmp_path / "zero.png"
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(zero)
    assert (read_label_map(zero, num_classes=4) == IGNORE_LABEL).all()


def test_ade20k_label_beyond_the_class_count_is_refused(tmp_path):
    path = tmp_path / "label.png"
    Image.fromarray(np.full((4, 4), 9, np.uint8)).save(path)
    with pytest.raises(ValueError, match="label 9 exceeds 4 classes"):
        read_label_map(path, num_classes=4)


def test_ade20k_image_without_its_annotation_is_named(tmp_path):
    make_ade20k_shapes(tmp_path, img_size=16, n=4)
    next((tmp_path / "annotations" / "validation").glob("*.png")).unlink()
    with pytest.raises(FileNotFoundError, match="ADE20K annotation not found"):
        ade20k_pairs(tmp_path, "val")


def _randaugmented(seed: int, magnitude: int = 9) -> torch.Tensor:
    """One 40 px noise image through the training transform: crop and flip, then RandAugment at ``magnitude``."""
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8))
    return classification_transform(32, uniform_from(torch.Generator().manual_seed(seed)), magnitude)(image)


def test_randaugment_draws_from_the_jobs_generator_alone_the_same_for_one_seed():
    before = torch.random.get_rng_state()
    first = _randaugmented(0)
    assert torch.equal(torch.random.get_rng_state(), before)  # the global generator is left as it was
    assert torch.equal(first, _randaugmented(0))
    assert not torch.equal(first, _randaugmented(1))
    assert not torch.equal(first, _randaugmented(0, magnitude=0))  # the same crop and flip, without RandAugment


def test_a_randaugment_magnitude_outside_one_to_ten_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"evaluation.finetune_randaugment: magnitude must be in 1\.\.10, got 11"):
        DrawnRandAugment(11, uniform_from(torch.Generator()))
