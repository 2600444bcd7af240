"""The pipeline flow: its parameter form in the Prefect UI is the whole config."""

from __future__ import annotations

from prefect.utilities.callables import parameter_schema

from flows.pipeline import vip_pipeline
from vip_core.config import tiny


def test_the_pipeline_form_is_the_config_with_every_field():
    schema = parameter_schema(vip_pipeline).model_dump()
    assert schema["properties"]["config"]["$ref"] == "#/definitions/VipConfig"
    assert schema["properties"]["config"]["default"]["name"] == "tiny"
    definitions = schema["definitions"]
    assert set(definitions["VipConfig"]["properties"]) == set(tiny().model_dump())
    privacy = definitions["PrivacyConfig"]["properties"]
    assert privacy["target_epsilon"]["default"] == 8.0
    assert set(privacy["accountant"]["enum"]) == {"pld", "prv", "rdp"}
