"""Wire types of the OpenAI Images API: the operator's bounds (``ImageLimits``), the generation fields every
endpoint shares (``ImageParams``, also the base of the chat request), the image requests and responses.

Requests are pydantic models (as in vLLM's own server), responses msgspec structs; a client mistake is an
``errors.OmniAPIError``. Image bytes are ``image_codec``'s.
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from vllm_omni_plugin.config.settings import non_finite
from vllm_omni_plugin.diffusion.params import MAX_PARTIAL_IMAGES
from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec
from vllm_omni_plugin.entrypoints.errors import OmniAPIError, decode_json

OutputFormat = Literal["png", "jpeg", "webp"]


@dataclass(frozen=True)
class ImageLimits:
    """What this server accepts on the wire: the operator's bounds (the model's sizes are the input
    processor's, ``stage/input_processor.py``)."""

    max_side: int = 2048
    """The largest height or width (``--image-max-size``); source images are bounded by it too."""
    max_upload_bytes: int = 20 * 1024 * 1024
    max_input_images: int = 4
    max_inference_steps: int = 1000
    max_prompt_chars: int = 32_000
    """The longest prompt in characters (``--image-max-prompt-chars``), checked before tokenizing."""
    max_aspect_ratio: float = 200.0
    """The most a source image's longer side may exceed its shorter one by (Qwen2-VL's image processor,
    Qwen-Image-Edit's, refuses more; no model here takes more)."""


_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX\u00d7]\s*(\d{1,6})\s*$")


def parse_size(size: str | None, param: str = "size") -> tuple[int, int] | None:
    """``"WIDTHxHEIGHT"`` -> ``(width, height)``; ``None``/``"auto"`` -> ``None`` (the default size). Whether
    the model can make it is the input processor's to say."""
    if size is None or size.strip().lower() == "auto":
        return None
    match = _SIZE.match(size)
    if match is None:
        raise OmniAPIError(f"size must be WIDTHxHEIGHT in pixels (e.g. 1024x1024), got {size!r}", param=param)
    return int(match.group(1)), int(match.group(2))


def check_prompt_length(text: str | None, limits: ImageLimits, param: str = "prompt") -> None:
    """Refuse, before anything tokenizes it, a prompt longer than the operator allows."""
    if text is not None and len(text) > limits.max_prompt_chars:
        raise OmniAPIError(
            f"{param} is {len(text)} characters; this server accepts at most {limits.max_prompt_chars} "
            "(--image-max-prompt-chars)",
            param=param,
        )


# OpenAI image fields we accept and ignore: they tune OpenAI's own models or its bookkeeping.
IGNORED_IMAGE_FIELDS = frozenset(
    {"quality", "style", "user", "safety_identifier", "moderation", "input_fidelity", "stream_options"}
)


# OpenAI image fields this deployment cannot honour when they ask for something.
UNSUPPORTED_IMAGE_FIELDS = frozenset(
    {"mask", "markup", "svg", "complexity", "frame_count", "frame_duration_ms"}
)


def _drop_ignored(data: Any, ignored: frozenset[str]) -> Any:
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        if key in ignored:
            continue
        if key in UNSUPPORTED_IMAGE_FIELDS:
            if value in (None, False, 0, ""):
                continue
            raise ValueError(f"{key} is not supported by this server")
        out[key] = value
    return out


def _is_number(annotation: Any) -> bool:
    """An ``int`` or ``float`` field (optional or not)."""
    return any(kind in (int, float) for kind in typing.get_args(annotation) or (annotation,))


class LoraRef(BaseModel):
    """A request's LoRA adapter with its scale (``"lora": {"name": "ink", "scale": 0.8}``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    scale: float = Field(default=1.0, ge=-10.0, le=10.0)


class ImageParams(BaseModel):
    """The generation knobs shared by every endpoint: OpenAI's plus the diffusion ones. Other fields are
    kept aside (``family_fields``) for the deployment's model family to read (its settings type, e.g.
    BAGEL's guidance), or to refuse as unknown."""

    model_config = ConfigDict(extra="allow")

    seed: int | None = Field(default=None, ge=0, lt=2**63)
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    negative_prompt: str | None = None
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)
    """Lower first (vLLM's field): a deployment whose diffusion stage has ``scheduling_policy: priority``
    runs better requests first, preempting worse ones between steps (``batching: loop``); others refuse
    any but 0."""
    lora: str | LoraRef | None = None
    """A LoRA adapter the server serves, by name (scale 1), or with its scale; a form sends the object as
    JSON text."""

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_json(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lstrip().startswith("{"):
            return decode_json(value, "lora", "lora")
        return value

    cache: Any = None
    """Step caching settings over the deployment's (``{"policy": "fixed", "compute_every": 2}``;
    ``{"policy": "none"}``: every step computed); a form sends the object as JSON text."""

    @field_validator("cache", mode="before")
    @classmethod
    def _cache(cls, value: Any) -> StepCacheSpec | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = decode_json(value, "cache", "cache")
        try:
            return msgspec.convert(value, StepCacheSpec)
        except msgspec.ValidationError as exc:
            raise ValueError(f"not step caching settings: {exc}") from None

    @field_validator("*", mode="before")
    @classmethod
    def _finite(cls, value: Any, info: ValidationInfo) -> Any:
        """NaN and the infinities (``"nan"``, ``"inf"``, ``1e999``) are no value a client means; unchecked,
        NaN fails only a bound, with a misleading message (``should be <= 100``)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _is_number(field.annotation) and non_finite(value):
            raise ValueError("must be a finite number")
        return value

    @property
    def family_fields(self) -> dict[str, Any]:
        """The fields this type does not know, as the client sent them."""
        return dict(self.model_extra or {})


class ImageGenerationRequest(ImageParams):
    """``POST /v1/images/generations``."""

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(default=1, ge=1, le=10)
    size: str | None = None
    response_format: Literal["b64_json", "url"] | None = None
    output_format: OutputFormat | None = None
    output_compression: int | None = Field(default=None, ge=0, le=100)
    background: Literal["opaque", "auto"] | None = None
    stream: bool = False
    """Answer as server-sent events (``entrypoints/streaming.py``)."""
    partial_images: int = Field(default=0, ge=0, le=MAX_PARTIAL_IMAGES)
    """Previews a streamed request gets while it denoises."""

    @model_validator(mode="before")
    @classmethod
    def _openai_fields(cls, data: Any) -> Any:
        return _drop_ignored(data, IGNORED_IMAGE_FIELDS)


class ImageEditRequest(ImageGenerationRequest):
    """``POST /v1/images/edits`` (multipart form; the images come as files, and an optional ``mask``)."""

    strength: float | None = Field(default=None, gt=0.0, le=1.0)
    """How far the image departs from its source, where the model's pipeline for it takes a strength
    (image-to-image and inpainting: 1.0 ignores the source); unset: the pipeline's own (0.6 for SD3,
    FLUX and Qwen-Image)."""


class ImageVariationRequest(ImageEditRequest):
    """``POST /v1/images/variations`` (multipart form: one ``image`` file): the source image redrawn, as
    an image-to-image of it with no prompt (``prompt`` is ours, to steer it) at the pipeline's own
    strength unless the request gives one."""

    prompt: str = ""


class ImageObject(msgspec.Struct, omit_defaults=True):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(msgspec.Struct, omit_defaults=True):
    created: int
    data: list[ImageObject]
    output_format: str | None = None
    size: str | None = None
    background: str | None = None
