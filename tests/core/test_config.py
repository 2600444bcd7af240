"""Configuration: presets build, configs are frozen and strict, and a bad value's error names its field."""

from __future__ import annotations

import pydantic
import pytest

from vip_core.config import (
    PRESETS, ConfigError, PrivacyConfig, VipConfig, flatten, get_preset, validate_config, with_overrides,
)
from vip_core.privacy.plan import plan_privacy


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_survives_a_json_round_trip(name):
    config = get_preset(name)
    assert isinstance(config, VipConfig)
    assert validate_config(config.model_dump(mode="json")) == config


def test_paper_preset_holds_the_published_recipe_and_its_noise():
    config = get_preset("vip-base-paper")
    assert (config.private.batch_size, config.private.steps) == (98_304, 6_000)
    assert config.privacy.target_epsilon == 8.0 and config.privacy.max_grad_norm == 0.1
    assert (config.privacy.noise_multiplier, config.privacy.accountant) == (0.48, "rdp")
    assert config.privacy.delta is None
    assert get_preset("vip-base").privacy.noise_multiplier is None  # calibrated for the measured N
    assert (config.model.embed_dim, config.model.patch_size, config.model.mask_ratio) == (768, 16, 0.75)


def test_configs_are_frozen():
    config = get_preset("tiny")
    with pytest.raises(pydantic.ValidationError):
        config.privacy.target_epsilon = 100.0


def test_unknown_fields_are_refused():
    with pytest.raises(pydantic.ValidationError, match="extra"):
        PrivacyConfig(epsilon=8.0)
    with pytest.raises(ConfigError, match=r"privacy\.epsilon: no such field"):
        with_overrides(get_preset("tiny"), {"privacy.epsilon": 8.0})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"privacy.noise_multiplier": -0.5}, "privacy.noise_multiplier"),
        ({"model.mask_ratio": 0.0}, "model.mask_ratio"),
        ({"model.mask_ratio": 1.0}, "model.mask_ratio"),
        ({"model.mask_ratio": 1.5}, "model.mask_ratio"),
        ({"privacy.delta": 1.0}, "privacy.delta"),
        ({"privacy.target_epsilon": 0}, "privacy.target_epsilon"),
        ({"privacy.accountant": "moments"}, "privacy.accountant"),
        ({"privacy.max_grad_norm": float("inf")}, "privacy.max_grad_norm"),  # would clip nothing
        ({"privacy.noise_multiplier": float("inf")}, "privacy.noise_multiplier"),
        ({"evaluation.finetune_privacy.max_grad_norm": float("inf")}, "evaluation.finetune_privacy.max_grad_norm"),
    ],
)
def test_bad_value_error_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as error:
        with_overrides(get_preset("tiny"), overrides)
    assert str(error.value).startswith(field), str(error.value)
    assert "\n" not in str(error.value)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="preset: unknown preset 'vip-huge'.*vip-base-paper"):
        get_preset("vip-huge")


def test_batch_larger_than_dataset_is_refused_naming_the_field():
    config = get_preset("vip-base")
    with pytest.raises(ConfigError, match=r"^private\.batch_size: 98304 is larger than the data set \(50000"):
        plan_privacy(config.privacy, dataset_size=50_000, batch_size=config.private.batch_size,
                     steps=config.private.steps, fingerprint="data")


def test_flatten_gives_dotted_string_params():
    params = flatten(get_preset("tiny"))
    assert params["privacy.max_grad_norm"] == "1.0"
    assert params["private.batch_size"] == "64"
    assert all(isinstance(value, str) for value in params.values())
