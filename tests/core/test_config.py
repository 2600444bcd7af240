"""Configuration: presets build, configs are frozen and strict, a bad value's error names its field, and a config
is the preset with a file's fields, a command's flags and ``FIELD=VALUE`` settings layered on it in that order."""

from __future__ import annotations

import pydantic
import pytest

from vip_core.config import (
    PRESETS, ConfigError, PrivacyConfig, VipConfig, config_yaml, flatten, get_preset, read_config_file,
    resolve_config, validate_config, with_overrides,
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
    with pytest.raises(ConfigError, match=r"^unknown config field privacy\.epsilon \(did you mean privacy\.target_epsilon\?\)$"):
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
        ({"private.augmentation_multiplicity": 0}, "private.augmentation_multiplicity"),
        ({"private.ema_decay": 1.0}, "private.ema_decay"),  # would never move from the initial weights
        ({"synthetic.ema_decay": -0.1}, "synthetic.ema_decay"),
        ({"evaluation.encoder_weights": "best"}, "evaluation.encoder_weights"),
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


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_presets_yaml_reads_back_as_exactly_the_preset(name, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(config_yaml(get_preset(name)))
    assert resolve_config("tiny", file=path) == get_preset(name)


@pytest.mark.parametrize(("suffix", "text"), [
    (".yaml", "privacy:\n  target_epsilon: 4\nprivate: {steps: 30}\n"),
    (".yml", "privacy:\n  target_epsilon: 4\nprivate: {steps: 30}\n"),
    (".toml", "[privacy]\ntarget_epsilon = 4\n[private]\nsteps = 30\n"),
    (".json", '{"privacy": {"target_epsilon": 4}, "private": {"steps": 30}}'),
])
def test_a_partial_file_changes_only_the_fields_it_names(suffix, text, tmp_path):
    path = tmp_path / f"mine{suffix}"
    path.write_text(text)
    config = resolve_config("vip-pico", file=path)
    expected = with_overrides(get_preset("vip-pico"), {"privacy.target_epsilon": 4.0, "private.steps": 30})
    assert config == expected


def test_the_file_then_the_flags_then_the_settings_win(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("privacy: {target_epsilon: 4, max_grad_norm: 0.5}\nprivate: {steps: 3, batch_size: 32}\n")
    config = resolve_config("tiny", file=path, overrides={"private.steps": 5, "private.batch_size": 48},
                            settings=["private.batch_size=40", "privacy.delta=1e-6"])
    assert (config.privacy.target_epsilon, config.privacy.max_grad_norm) == (4.0, 0.5)  # the file over the preset
    assert config.private.steps == 5  # a flag over the file
    assert config.private.batch_size == 40 and config.privacy.delta == 1e-6  # a setting over both
    assert config.synthetic == get_preset("tiny").synthetic


@pytest.mark.parametrize(("setting", "field", "value"), [
    ("private.steps=4", "private.steps", 4),
    ("privacy.secure_mode=true", "privacy.secure_mode", True),
    ("evaluation.tasks=[linprobe, coco]", "evaluation.tasks", ("linprobe", "coco")),
    ("evaluation.linprobe_batch_size=null", "evaluation.linprobe_batch_size", None),
    ("name='2024'", "name", "2024"),
    ("evaluation.finetune_privacy={enabled: true, steps: 7}", "evaluation.finetune_privacy.steps", 7),
])
def test_a_settings_value_is_read_as_yaml(setting, field, value):
    config = resolve_config("tiny", settings=[setting])
    node = config
    for key in field.split("."):
        node = getattr(node, key)
    assert node == value


@pytest.mark.parametrize(("settings", "message"), [
    (["privacy.target_epsilonn=4"], "unknown config field privacy.target_epsilonn (did you mean privacy.target_epsilon?)"),
    (["privacy.xyz=4"], "unknown config field privacy.xyz (privacy has: enabled, target_epsilon, delta, "),
    (["models.depth=4"], "unknown config field models (did you mean model?)"),
    (["model.depth.x=4"], "unknown config field model.depth.x (model.depth is a value, not a section)"),
    (["privacy.target_epsilon=-4"], "privacy.target_epsilon: Input should be greater than 0"),
    (["private.steps=many"], "private.steps: Input should be a valid integer"),
    (["private.steps"], "malformed setting 'private.steps': expected FIELD=VALUE, such as privacy.target_epsilon=4"),
    (["=4"], "malformed setting '=4': expected FIELD=VALUE"),
    (["evaluation.tasks=[linprobe"], "setting evaluation.tasks: cannot read the value '[linprobe' (expected ',' or ']'"),
])
def test_a_bad_setting_is_one_line_naming_the_field(settings, message):
    with pytest.raises(ConfigError) as error:
        resolve_config("tiny", settings=settings)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize(("name", "text", "message"), [
    ("missing.yaml", None, "config file {path}: cannot be read (No such file or directory)"),
    ("bad.yaml", "privacy: [1\n", "config file {path}: not valid YAML: expected ',' or ']', but got '<stream end>'"),
    ("bad.toml", "[privacy\n", "config file {path}: not valid TOML: "),
    ("bad.json", "{privacy: 1}", "config file {path}: not valid JSON: Expecting property name"),
    ("list.yaml", "- 1\n- 2\n", "config file {path}: holds a list, not sections of fields"),
    ("notes.txt", "privacy: {}\n", "config file {path}: the name must end in .yaml, .yml, .toml, .json"),
    ("typo.yaml", "privacy:\n  target_epsilonn: 4\n", "unknown config field privacy.target_epsilonn (did you mean"),
])
def test_a_bad_file_is_one_line_naming_it(name, text, message, tmp_path):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as error:
        resolve_config("tiny", file=path)
    assert str(error.value).startswith(message.format(path=path)) and "\n" not in str(error.value), str(error.value)


def test_an_empty_file_changes_nothing(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    assert read_config_file(path) == {} and resolve_config("tiny", file=path) == get_preset("tiny")
