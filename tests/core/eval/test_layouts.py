"""The paper's data sets in their own layouts, on small generated copies: ImageNet (``train/<wnid>/*.JPEG``,
``val/<wnid>/``), iNaturalist 2021 (its numbered taxonomy folders), COCO 2017 and ADE20K (``ADEChallengeData2016``)
at their images' own sizes; each read by its job end to end on the tiny preset's random-init encoder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.fixtures.eval_sets import (
    IMAGENET_WNIDS, INAT2021_FOLDERS, make_ade20k_shapes, make_coco_shapes, make_imagenet_layout,
    make_inat2021_layout,
)
from vip_core.config import tiny
from vip_core.eval.datasets import CocoDetectionDataset, load_rgb, open_classification
from vip_core.eval.detection import open_coco
from vip_core.eval.jobs import prepare_job
from vip_core.models import build_encoder

CPU = torch.device("cpu")


def random_encoder():
    torch.manual_seed(0)
    return build_encoder(tiny().model)


@pytest.mark.parametrize("make, folders", [(make_imagenet_layout, IMAGENET_WNIDS),
                                           (make_inat2021_layout, INAT2021_FOLDERS)])
def test_imagenet_and_inaturalist_layouts_are_read_by_class_folder_and_probed_above_chance(tmp_path, make, folders):
    summary = make(tmp_path, side=48, per_class=30)
    data = open_classification(tmp_path)
    assert data.classes == tuple(sorted(folders))
    train, val = data.split("train", 32), data.split("val", 32)
    assert (len(train), len(val)) == (summary["train"], summary["val"]) == (240, 60)
    sizes = {Image.open(path).size for path, _ in train.samples}
    assert len(sizes) > 1 and max(max(size) for size in sizes) == 48, "photographs of their own sizes"
    assert train[0][0].shape == (3, 32, 32)
    config = tiny()
    evaluation = config.evaluation.model_copy(update={"batch_size": 32})
    metrics = prepare_job("linprobe", tmp_path, evaluation, config.model, CPU)(random_encoder())
    assert metrics["top1"] >= 2 * metrics["chance_top1"], metrics


def test_a_jpeg_is_decoded_at_the_smallest_scale_that_still_covers_the_crop(tmp_path):
    path = tmp_path / "photo.JPEG"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 400, 3), dtype=np.uint8)).save(path)
    assert load_rgb(path).size == (400, 300)
    assert load_rgb(path, 64).size == (100, 75)  # a quarter: the next scale down would leave 37 px rows
    assert load_rgb(path, 224).size == (400, 300)


def test_coco_at_its_images_own_sizes_keeps_boxes_in_each_images_frame(tmp_path):
    make_coco_shapes(tmp_path, img_size=48, n=8, own_sizes=True)
    splits = open_coco(tmp_path)
    images = splits["train"]["data"]["images"]
    assert len({(image["width"], image["height"]) for image in images}) > 1
    dataset = CocoDetectionDataset(splits["train"]["data"], splits["train"]["images"], 32, with_masks=True)
    for index in range(len(dataset)):
        image, target = dataset[index]
        assert image.shape == (3, 32, 32) and target["masks"].shape[1:] == (32, 32)
        assert bool((target["boxes"] >= 0).all() and (target["boxes"] <= 32).all())
    config = tiny()
    metrics = prepare_job("coco", tmp_path, config.evaluation, config.model, CPU)(random_encoder())
    assert 0.0 <= metrics["ap_box"] <= 1.0 and 0.0 <= metrics["ap_mask"] <= 1.0


def test_ade20k_challenge_folder_at_its_images_own_sizes_is_scored_at_each_label_maps_size(tmp_path):
    make_ade20k_shapes(tmp_path / "ADEChallengeData2016", img_size=48, n=8, own_sizes=True)
    (tmp_path / "ADEChallengeData2016" / "sceneCategories.txt").write_text("ADE_train_00000001 abbey\n")
    labels = sorted((tmp_path / "ADEChallengeData2016" / "annotations" / "validation").iterdir())
    assert len({Image.open(path).size for path in labels}) > 1
    config = tiny()
    metrics = prepare_job("ade20k", tmp_path, config.evaluation, config.model, CPU)(random_encoder())
    assert metrics["num_classes"] == 4 and 0.0 <= metrics["miou"] <= 1.0
    assert json.loads(json.dumps(metrics)) == metrics
