"""A family's request settings type (``config/settings.py``): the values a request may add beyond OpenAI's
fields, read and refused with the messages the HTTP layer gave when it declared them itself (pydantic's)."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_omni_plugin.config.pipeline import get_pipeline, registered_pipelines
from vllm_omni_plugin.config.settings import RequestSettings, SettingError, read_settings

NAN = float("nan")


def bagel_settings() -> type[RequestSettings]:
    settings = get_pipeline("bagel").settings_type
    assert settings is not None
    return settings


@pytest.mark.parametrize(
    ("fields", "given"),
    [
        ({"cfg_text_scale": "4.5"}, {"cfg_text_scale": 4.5}),
        ({"cfg_text_scale": True}, {"cfg_text_scale": 1.0}),
        ({"cfg_text_scale": None}, {}),
        ({"think": "true"}, {"think": True}),
        ({"think": 1}, {"think": True}),
        ({"max_think_tokens": "8"}, {"max_think_tokens": 8}),
        ({"cfg_interval": [0.0, 1.0], "cfg_renorm_type": "channel"}, {"cfg_interval": (0.0, 1.0), "cfg_renorm_type": "channel"}),
    ],
)  # fmt: skip
def test_bagel_settings_read_what_the_client_gave(fields: dict[str, Any], given: dict[str, Any]) -> None:
    assert read_settings(bagel_settings(), fields).given() == given


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"cfg_text_scale": -1}, "cfg_text_scale: Input should be greater than or equal to 0", "cfg_text_scale"),
        ({"cfg_text_scale": 101}, "cfg_text_scale: Input should be less than or equal to 100", "cfg_text_scale"),
        ({"cfg_text_scale": NAN}, "cfg_text_scale: must be a finite number", "cfg_text_scale"),
        ({"cfg_text_scale": "-inf"}, "cfg_text_scale: must be a finite number", "cfg_text_scale"),
        ({"max_think_tokens": "nan"}, "max_think_tokens: must be a finite number", "max_think_tokens"),
        ({"cfg_interval": [0.4, float("inf")]}, "cfg_interval.1: must be a finite number", "cfg_interval.1"),
        ({"cfg_text_scale": "abc"}, "cfg_text_scale: Input should be a valid number, unable to parse string as a number", "cfg_text_scale"),
        ({"cfg_img_scale": -0.5}, "cfg_img_scale: Input should be greater than or equal to 0", "cfg_img_scale"),
        ({"cfg_interval": [0.5, 0.2]}, "cfg_interval must be [lo, hi] with 0 <= lo <= hi <= 1, got [0.5, 0.2]", None),
        ({"cfg_interval": [0.1, 2]}, "cfg_interval must be [lo, hi] with 0 <= lo <= hi <= 1, got [0.1, 2.0]", None),
        ({"cfg_interval": [0.1]}, "cfg_interval.1: Field required", "cfg_interval.1"),
        ({"cfg_interval": "x"}, "cfg_interval: Input should be a valid tuple", "cfg_interval"),
        ({"cfg_renorm_type": "loud"}, "cfg_renorm_type: Input should be 'global', 'channel' or 'text_channel'", "cfg_renorm_type"),
        ({"cfg_renorm_min": 2}, "cfg_renorm_min: Input should be less than or equal to 1", "cfg_renorm_min"),
        ({"timestep_shift": 0}, "timestep_shift: Input should be greater than 0", "timestep_shift"),
        ({"timestep_shift": 101}, "timestep_shift: Input should be less than or equal to 100", "timestep_shift"),
        ({"think": "maybe"}, "think: Input should be a valid boolean, unable to interpret input", "think"),
        ({"max_think_tokens": 1}, "max_think_tokens: Input should be greater than or equal to 2", "max_think_tokens"),
        ({"max_think_tokens": 40000}, "max_think_tokens: Input should be less than or equal to 32768", "max_think_tokens"),
        ({"max_think_tokens": 2.5}, "max_think_tokens: Input should be a valid integer, got a number with a fractional part", "max_think_tokens"),
        ({"cfg_text_scale": -1, "cfg_img_scale": -1}, "cfg_text_scale: Input should be greater than or equal to 0 (and 1 more problem)", "cfg_text_scale"),
    ],
)  # fmt: skip
def test_bagel_settings_refuse_bad_values_naming_them(
    fields: dict[str, Any], message: str, param: str | None
) -> None:
    with pytest.raises(SettingError) as info:
        read_settings(bagel_settings(), fields)
    assert (info.value.message, info.value.param) == (message, param)


def test_every_family_declares_its_settings_type() -> None:
    """Each registered family names a settings type; only BAGEL's has fields, the same as the DiT stage's
    ``default_sampling_params`` may set."""
    pipelines = registered_pipelines()
    assert {"glm_image", "bagel", "diffusion"} <= set(pipelines)
    for name in ("glm_image", "bagel", "diffusion"):
        settings = pipelines[name].settings_type
        assert settings is not None and issubclass(settings, RequestSettings), name
    assert pipelines["glm_image"].setting_names == pipelines["diffusion"].setting_names == ()
    assert set(pipelines["bagel"].setting_names) == {
        "cfg_text_scale", "cfg_img_scale", "cfg_interval", "cfg_renorm_type", "cfg_renorm_min",
        "timestep_shift", "think", "max_think_tokens",
    }  # fmt: skip
