import numpy as np
import pytest

from vip_core.data.objects import REGIONS, SHAPES, ObjectStyle, generate_objects, region_photos


def test_the_same_seed_gives_the_same_images_and_another_seed_other_ones():
    images, labels = generate_objects(64, seed=3, region="private")
    again, again_labels = generate_objects(64, seed=3, region="private")
    other, _ = generate_objects(64, seed=4, region="private")
    assert images.shape == (64, 32, 32, 3) and images.dtype == np.uint8 and labels.shape == (64,)
    assert np.array_equal(images, again) and np.array_equal(labels, again_labels)
    assert not np.array_equal(images, other)


def test_every_shape_class_is_drawn_and_the_object_differs_from_its_background():
    images, labels = generate_objects(2000, seed=0, region="downstream", style=ObjectStyle(pixel_noise=0.0))
    assert set(labels.tolist()) == set(range(len(SHAPES)))
    centre = images[:, 12:20, 12:20].astype(float).std(axis=(1, 2)).mean()  # objects cover the centre
    assert centre > 0


def test_the_regions_share_no_columns_of_any_photograph():
    low_private, high_private = REGIONS["private"]
    low_downstream, _ = REGIONS["downstream"]
    assert high_private <= low_downstream
    for private, downstream in zip(region_photos("private", 96), region_photos("downstream", 96)):
        assert private.shape[1] + downstream.shape[1] <= int(private.shape[1] / (high_private - low_private)) + 2


def test_an_unknown_region_is_one_line():
    with pytest.raises(ValueError, match="region: unknown region 'public'"):
        generate_objects(4, seed=0, region="public")
