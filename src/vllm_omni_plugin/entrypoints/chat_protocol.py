"""Wire types of chat completions with image output (and text answers): the request (``ImageParams`` and
the chat fields), reading its last user message, and the response."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
from pydantic import Field, model_validator

from vllm_omni_plugin.entrypoints.errors import OmniAPIError
from vllm_omni_plugin.entrypoints.image_codec import decode_data_uri, mask_from_alpha
from vllm_omni_plugin.entrypoints.image_protocol import ImageLimits, ImageParams, OutputFormat

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


MAX_TOKENS = 2**31 - 1
"""A bound on ``max_tokens`` before it reaches an engine (whose wire carries 64-bit integers at most);
the AR stage's own ``max_model_len`` bounds it further."""


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


def chat_prompt_and_images(
    messages: list[dict[str, Any]], limits: ImageLimits
) -> tuple[str, list[np.ndarray], np.ndarray | None]:
    """The last user message's text (the prompt), its ``image_url`` parts (the source images) and the
    mask of a masked edit: an ``image_url`` part marked ``"mask": true`` (``{"type": "image_url",
    "image_url": {"url": "data:image/png;base64,...", "mask": true}}``: a PNG of the image's size whose
    transparent pixels are repainted, as the Images API's ``mask``), with exactly one image."""
    index = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "user"), None)
    if index is None:
        raise OmniAPIError("messages: there is no user message to draw", param="messages")
    content = messages[index].get("content")
    texts: list[str] = []
    images: list[np.ndarray] = []
    mask: tuple[np.ndarray, str] | None = None
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
            if isinstance(ref, dict) and ref.get("mask") is True:
                if mask is not None:
                    raise OmniAPIError(f"{where}: a second mask; send one", param="messages")
                mask = (decode_data_uri(url, limits, f"{where}.image_url", mode="RGBA"), f"{where}.image_url")
                continue
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
    if mask is None:
        return prompt, images, None
    if len(images) != 1:
        raise OmniAPIError(
            f"messages[{index}]: a mask marks one image: send one image with it, not {len(images)}",
            param="messages",
        )
    return prompt, images, mask_from_alpha(mask[0], images[0].shape[:2], mask[1])


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
