"""Wire types of the OpenAI Images API (and of chat completions with image output) for the omni server.

Requests are pydantic models (as in vLLM's own server); every client mistake becomes an
:class:`OmniAPIError`, which the server turns into OpenAI's error JSON
(``{"error": {"message", "type", "param", "code"}}``, with vLLM's ``type`` names and the HTTP status as
``code``). Responses are msgspec structs. Images travel as PNG/JPEG/WebP bytes; decoding and encoding
live here so the server module only routes.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import typing
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal, TypeVar

import msgspec
import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vllm_omni_plugin.config.settings import non_finite
from vllm_omni_plugin.diffusion.params import MAX_PARTIAL_IMAGES
from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

OutputFormat = Literal["png", "jpeg", "webp"]
MEDIA_TYPES: dict[str, str] = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
PIL_FORMATS: dict[str, str] = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


class OmniAPIError(Exception):
    """A request the server answers with an error JSON instead of a result."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


def error_body(message: str, status: int, param: str | None = None) -> bytes:
    err_type = ERROR_TYPES.get(status)
    if err_type is None:
        try:
            err_type = HTTPStatus(status).phrase.replace(" ", "") + "Error"
        except ValueError:
            err_type = "Error"
    return msgspec.json.encode(ErrorResponse(ErrorInfo(message, err_type, param, status)))


# --- JSON in -----------------------------------------------------------------------------------

MAX_JSON_DEPTH = 64
"""How deeply a request's JSON may nest (a chat request with image parts nests 5 levels). Deeper JSON is
refused before anything walks it: a body of 100,000 ``[`` would otherwise exhaust the recursion limit."""

# float_hook: a number out of float range (1e999) reads as inf, which the request types refuse naming
# its field, instead of failing the whole body as "Number out of range".
_JSON_DECODER = msgspec.json.Decoder(float_hook=float)
_TOO_DEEP = object()


def decode_json(data: bytes | str, what: str = "the request body", param: str | None = None) -> Any:
    """JSON text -> Python values; malformed or nested deeper than :data:`MAX_JSON_DEPTH` -> 400."""
    try:
        value = _JSON_DECODER.decode(data)
    except RecursionError:
        value = _TOO_DEEP
    except msgspec.DecodeError as exc:
        raise OmniAPIError(f"{what} is not valid JSON ({exc})", param=param) from None
    if value is _TOO_DEEP or _nested_deeper_than(value, MAX_JSON_DEPTH):
        raise OmniAPIError(
            f"{what} is JSON nested too deeply (this server reads at most {MAX_JSON_DEPTH} levels of "
            "arrays and objects)",
            param=param,
        )
    return value


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value``'s lists and dicts nest more than ``limit`` levels (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


# --- limits ------------------------------------------------------------------------------------


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


# --- requests ----------------------------------------------------------------------------------

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


MAX_TOKENS = 2**31 - 1
"""A bound on ``max_tokens`` before it reaches an engine (whose wire carries 64-bit integers at most);
the AR stage's own ``max_model_len`` bounds it further."""


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
    """``POST /v1/images/edits`` (multipart form; the images come as files)."""


# Standard chat-completion fields that do not apply to image output: accepted, ignored.
IGNORED_CHAT_FIELDS = frozenset(
    {
        "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
        "metadata", "parallel_tool_calls", "prediction",
        "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort",
        "response_format", "safety_identifier", "service_tier", "stop", "store", "stream_options",
        "tool_choice", "tools", "top_logprobs", "user", "verbosity", "web_search_options",
    }
)  # fmt: skip


class ChatCompletionRequest(ImageParams):
    """``POST /v1/chat/completions``: ``"modalities": ["image"]`` asks for an image; without it (or with
    ``["text"]``) pipelines that answer in text (BAGEL: understanding and chat) answer in text.

    Image parameters may sit at the top level or in a literal ``extra_body`` object (what some
    examples send with curl); the OpenAI client merges its ``extra_body`` into the top level.
    """

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    modalities: list[str] | None = None
    n: int = Field(default=1, ge=1, le=10)
    stream: bool = False
    size: str | None = None
    height: int | None = None
    width: int | None = None
    output_format: OutputFormat | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)

    @property
    def wants_image(self) -> bool:
        return "image" in (self.modalities or [])

    @model_validator(mode="before")
    @classmethod
    def _merge_extra_body(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if k not in IGNORED_CHAT_FIELDS}
        extra = data.pop("extra_body", None)
        if extra is not None:
            if not isinstance(extra, dict):
                raise ValueError("extra_body must be an object")
            for key, value in extra.items():
                data.setdefault(key, value)
        return data

    def sampling_params(self) -> dict[str, Any]:
        """AR-stage sampling overrides (temperature / top_p / top_k; for a text answer its length), when
        given."""
        names = ("temperature", "top_p", "top_k")
        params = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if not self.wants_image and (self.max_completion_tokens or self.max_tokens):
            params["max_tokens"] = self.max_completion_tokens or self.max_tokens
        return params


RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(cls: type[RequestT], data: Any) -> RequestT:
    """Validate ``data`` against ``cls``; the first problem becomes one 400 with its field as ``param``."""
    if not isinstance(data, dict):
        raise OmniAPIError("the request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        loc = [str(p) for p in first.get("loc", ())]
        param = ".".join(loc) or None
        if first.get("type") == "extra_forbidden":
            message = f"unknown field {param!r}"
        else:
            message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
            if param:
                message = f"{param}: {message}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        raise OmniAPIError(message, param=param) from None


# --- images in ---------------------------------------------------------------------------------


def decode_image(
    data: bytes, limits: ImageLimits, param: str = "image", name: str | None = None
) -> np.ndarray:
    """Uploaded bytes -> uint8 HxWx3 RGB; too many bytes or pixels -> 413, empty or not an image -> 400.
    ``name`` (the upload's file name) says which image in the messages."""
    from PIL import Image, UnidentifiedImageError

    subject = repr(name) if name else "the image"
    if len(data) > limits.max_upload_bytes:
        raise OmniAPIError(
            f"{param}: {subject} is {len(data)} bytes; this server accepts at most {limits.max_upload_bytes} "
            "bytes per image",
            status=413,
            param=param,
        )
    if not data:
        raise OmniAPIError(f"{param}: {subject} is empty (0 bytes)", param=param)
    max_pixels = max_image_pixels(limits)
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise OmniAPIError(
                    f"{param}: {subject} is too large: {width}x{height} is {width * height} pixels; this "
                    f"server accepts at most {max_pixels} pixels",
                    status=413,
                    param=param,
                )
            if max(width, height) > limits.max_aspect_ratio * max(1, min(width, height)):
                most = f"{limits.max_aspect_ratio:g}:1"
                raise OmniAPIError(
                    f"{param}: {subject} is {width}x{height}, an aspect ratio over {most}; this server "
                    f"accepts at most {most}",
                    param=param,
                )
            image.load()
            return np.asarray(image.convert("RGB"), dtype=np.uint8).copy()
    except OmniAPIError:
        raise
    except Image.DecompressionBombError as exc:
        # PIL refuses, in Image.open, a header declaring more than twice its MAX_IMAGE_PIXELS, before our
        # own check sees the size; its message carries the pixel count.
        found = re.search(r"\((\d+) pixels\)", str(exc))
        pixels = f"{found.group(1)} pixels" if found else "more pixels than PIL decodes"
        raise OmniAPIError(
            f"{param}: {subject} is too large: {pixels}; this server accepts at most {max_pixels} pixels",
            status=413,
            param=param,
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise OmniAPIError(
            f"{param}: cannot decode {subject} as a PNG, JPEG or WebP image", param=param
        ) from None


def max_image_pixels(limits: ImageLimits) -> int:
    """The most pixels a source image may have: room to resize one four times the largest output side."""
    return (4 * limits.max_side) ** 2


_DATA_URI = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)$", re.S | re.I
)
"""RFC 2397: the scheme, media type and ``base64`` are case-insensitive (``DATA:image/PNG;BASE64,``)."""


def decode_data_uri(url: str, limits: ImageLimits, param: str) -> np.ndarray:
    """A ``data:image/...;base64,...`` URI -> uint8 HxWx3; this server never fetches remote URLs."""
    match = _DATA_URI.match(url.strip())
    if match is None:
        raise OmniAPIError(
            f"{param}: only base64 data URIs (data:image/png;base64,...) are accepted; this server does "
            "not fetch URLs",
            param=param,
        )
    payload = match.group("data")
    if len(payload) > 4 * (limits.max_upload_bytes // 3 + 2):
        raise OmniAPIError(
            f"{param}: the image is about {len(payload) * 3 // 4} bytes; this server accepts at most "
            f"{limits.max_upload_bytes} bytes per image",
            status=413,
            param=param,
        )
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise OmniAPIError(f"{param}: the data URI is not valid base64", param=param) from None
    return decode_image(raw, limits, param)


# --- chat messages -----------------------------------------------------------------------------


def chat_prompt_and_images(
    messages: list[dict[str, Any]], limits: ImageLimits
) -> tuple[str, list[np.ndarray]]:
    """The last user message's text (the prompt) and its ``image_url`` parts (the source images)."""
    index = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "user"), None)
    if index is None:
        raise OmniAPIError("messages: there is no user message to draw", param="messages")
    content = messages[index].get("content")
    texts: list[str] = []
    images: list[np.ndarray] = []
    parts: list[Any] = [content] if isinstance(content, str) else content if isinstance(content, list) else []
    if not parts:
        raise OmniAPIError(f"messages[{index}].content must be a string or a list of parts", param="messages")
    for j, part in enumerate(parts):
        where = f"messages[{index}].content[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind == "image_url":
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str):
                raise OmniAPIError(f"{where}.image_url.url must be a string", param="messages")
            if len(images) >= limits.max_input_images:
                raise OmniAPIError(
                    f"at most {limits.max_input_images} input images per request", param="messages"
                )
            images.append(decode_data_uri(url, limits, f"{where}.image_url"))
        else:
            raise OmniAPIError(
                f"{where}: unsupported content part type {kind!r} (text and image_url are accepted)",
                param="messages",
            )
    prompt = "\n".join(t for t in texts if t.strip()).strip()
    if not prompt:
        raise OmniAPIError(f"messages[{index}] has no text to draw from", param="messages")
    return prompt, images


# --- images out --------------------------------------------------------------------------------


def encode_image(image: Any, output_format: str = "png", compression: int | None = None) -> bytes:
    """A uint8 HxWx3 array -> encoded bytes (``compression`` is OpenAI's 0-100, for JPEG/WebP)."""
    from PIL import Image

    pil = Image.fromarray(np.asarray(image, dtype=np.uint8))
    out = io.BytesIO()
    kwargs: dict[str, Any] = {}
    if output_format in ("jpeg", "webp"):
        kwargs["quality"] = 100 - compression if compression is not None else 90
    pil.save(out, format=PIL_FORMATS[output_format], **kwargs)
    return out.getvalue()


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


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]]
    """Text, or content parts: an image answer is ``[{"type": "image_url", "image_url": {"url":
    "data:image/png;base64,..."}}]`` (what OpenAI-style and vllm-omni clients read), followed by a
    ``{"type": "text", ...}`` part when the model also wrote text (BAGEL's plan in think mode)."""


def image_content(uri: str, text: str | None = None) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": uri}}]
    if text:
        parts.append({"type": "text", "text": text})
    return parts


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: str = "stop"
    logprobs: None = None


class ChatUsage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    object: str = "chat.completion"
    usage: ChatUsage | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "vllm-omni-plugin"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model (as vLLM lists its adapters)."""
    object: str = "model"


class LoadLoraRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    lora_name: str = Field(min_length=1)


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


def data_uri(encoded: bytes, output_format: str) -> str:
    return f"data:{MEDIA_TYPES[output_format]};base64,{base64.b64encode(encoded).decode('ascii')}"
