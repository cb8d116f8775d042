"""What Dynamo's frontend (ai-dynamo-runtime 1.6) sends a worker registered with ``ModelType.Images |
ModelType.Chat`` and ``ModelInput.Text``, mapped onto our request types, and our answers mapped onto
what it reads back. Pure data: nothing here imports Dynamo.

What the frontend sends (it validates the OpenAI fields it knows, then forwards the request as a dict):

- ``/v1/images/generations``: OpenAI's fields (``stream`` and ``partial_images`` too, though it answers
  with one JSON body: refused here), ``nvext`` with the diffusion knobs it knows (``seed``,
  ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``; others it drops) and, under
  ``extra_args.media_passthrough``, every top-level field it does not know (an OpenAI client's
  ``extra_body``, e.g. BAGEL's ``cfg_text_scale``).
- ``/v1/images/edits``: JSON only (a multipart form is its 415), the source image as a data URI in
  ``input_reference``; more images travel as the passthrough field ``images`` (data URIs, or OpenAI's
  ``{"image_url": ...}`` objects).
- ``/v1/chat/completions``: OpenAI's fields; it refuses unknown ones and ``"modalities": ["image"]``, so
  an image is what a chat request gets unless it says ``"modalities": ["text"]``, and image settings
  travel in ``chat_template_kwargs`` (which it forwards as ``chat_template_args``).

Replies are plain dicts (the frontend's image types move into Rust between releases): the Images API
body, or ``chat.completion.chunk``s, which the frontend streams or folds into one completion. A request
that fails raises one of Dynamo's exceptions, by status (:func:`dynamo_error`): in 1.6 only
``InvalidArgument`` carries its message to the client (as a 400); the others reach it as a bare status.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from vllm_omni_plugin.entrypoints.chat_protocol import ChatCompletionResponse
from vllm_omni_plugin.entrypoints.errors import OmniAPIError
from vllm_omni_plugin.entrypoints.image_protocol import ImagesResponse

GENERATIONS = "images/generations"
EDITS = "images/edits"
CHAT = "chat/completions"

NVEXT_FIELDS = ("seed", "num_inference_steps", "guidance_scale", "negative_prompt")
"""The diffusion knobs Dynamo's image ``nvext`` carries, which our request types read at the top level."""
DYNAMO_FIELDS = ("nvext", "extra_args")
"""What the frontend adds to a request (read above, not fields of ours)."""
CHAT_SETTINGS = ("chat_template_args", "chat_template_kwargs")
"""Where a chat request's image settings travel (the frontend refuses unknown top-level fields)."""
STREAM_FIELDS = ("stream", "stream_options")
"""Chat streaming is the frontend's: the worker answers in chunks either way."""
IMAGE_STREAM_FIELDS = ("stream", "partial_images")
"""The frontend (1.6) answers an Images API call with one JSON body, so these cannot be honoured."""
EDIT_IMAGES = "images"
"""The passthrough field with an edit's images beyond ``input_reference``."""


def endpoint_of(request: Any) -> str:
    """Which API the frontend is calling (it sends the three to one endpoint)."""
    if not isinstance(request, dict):
        raise OmniAPIError("the request must be a JSON object")
    if "messages" in request:
        return CHAT
    if "input_reference" in request:
        return EDITS
    if "prompt" in request:
        return GENERATIONS
    raise OmniAPIError(
        "the request is neither an image generation (prompt), an image edit (input_reference) nor a chat "
        "completion (messages)"
    )


def image_fields(request: Mapping[str, Any]) -> dict[str, Any]:
    """An Images API request as our request types read it: the frontend's own fields, ``nvext``'s knobs and
    the passthrough fields side by side at the top level (a field given twice must agree)."""
    fields = {key: value for key, value in request.items() if key not in DYNAMO_FIELDS}
    nvext = _mapping(request.get("nvext"), "nvext")
    given = {key: nvext[key] for key in NVEXT_FIELDS if nvext.get(key) is not None}
    _merge(fields, given, "nvext")
    _merge(fields, passthrough(request), "extra_body")
    for key in IMAGE_STREAM_FIELDS:
        if fields.pop(key, None):
            raise OmniAPIError(
                f"{key}: Dynamo's frontend answers the Images API with one JSON body, so images are not "
                "streamed through it; leave stream and partial_images unset (chat completions stream)",
                param=key,
            )
    return fields


def passthrough(request: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level fields the frontend does not know, which it forwards aside."""
    extra = _mapping(request.get("extra_args"), "extra_args")
    return dict(_mapping(extra.get("media_passthrough"), "extra_args.media_passthrough"))


def edit_fields(request: Mapping[str, Any], max_images: int) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """An edit's fields without its images, and its images as (where, data URI): ``input_reference`` first,
    then ``images``, at most ``max_images`` of them."""
    fields = image_fields(request)
    sources: list[tuple[str, Any]] = [("input_reference", fields.pop("input_reference", None))]
    more = fields.pop(EDIT_IMAGES, None)
    if more is not None:
        if not isinstance(more, list):
            raise OmniAPIError(f"{EDIT_IMAGES} must be a list of images (data URIs)", param=EDIT_IMAGES)
        sources += [(f"{EDIT_IMAGES}[{i}]", _image_url(item)) for i, item in enumerate(more)]
    if len(sources) > max_images:
        raise OmniAPIError(
            f"too many images: this server takes at most {max_images} per request (input_reference and "
            f"{EDIT_IMAGES}), got {len(sources)}",
            param=EDIT_IMAGES,
        )
    for where, url in sources:
        if not isinstance(url, str) or not url:
            raise OmniAPIError(
                f"{where} must be an image as a data URI (data:image/png;base64,...)", param=where
            )
    return fields, sources


def chat_fields(request: Mapping[str, Any]) -> dict[str, Any]:
    """A chat request as our chat request type reads it: ``chat_template_kwargs`` at the top level, and an
    image answer unless the request asks for text."""
    dropped = (*DYNAMO_FIELDS, *CHAT_SETTINGS, *STREAM_FIELDS)
    fields = {key: value for key, value in request.items() if key not in dropped}
    for key in CHAT_SETTINGS:
        _merge(fields, _mapping(request.get(key), key), "chat_template_kwargs")
    fields.setdefault("modalities", ["image"])
    return fields


def images_reply(body: ImagesResponse) -> dict[str, Any]:
    """The Images API body, as the frontend reads it back (``created`` and ``data`` are what it needs)."""
    return msgspec.to_builtins(body)


def chat_chunks(body: ChatCompletionResponse) -> list[dict[str, Any]]:
    """A chat completion as the one ``chat.completion.chunk`` the frontend streams, or folds into a
    completion: each choice's message as its delta (content parts for an image answer)."""
    chunk: dict[str, Any] = {
        "id": body.id,
        "object": "chat.completion.chunk",
        "created": body.created,
        "model": body.model,
        "choices": [
            {
                "index": choice.index,
                "delta": {"role": choice.message.role, "content": choice.message.content},
                "finish_reason": choice.finish_reason,
                "logprobs": None,
            }
            for choice in body.choices
        ],
    }
    if body.usage is not None:
        chunk["usage"] = msgspec.to_builtins(body.usage)
    return [chunk]


def dynamo_error(status: int) -> str:
    """The Dynamo exception (``dynamo.llm.exceptions``) a failure of this HTTP status is raised as: the
    frontend answers ``InvalidArgument`` with 400 and its message, ``Disconnected`` with 503,
    ``Cancelled`` with 499 and ``Unknown`` with 500. Not ``WorkerUnavailable``, ``EngineShutdown`` or
    ``StreamIncomplete``: after those the frontend stops routing to this worker."""
    if status == 499:
        return "Cancelled"
    if status < 500:
        return "InvalidArgument"
    if status == 503:
        return "Disconnected"
    return "Unknown"


def _merge(fields: dict[str, Any], extra: Mapping[str, Any], where: str) -> None:
    for key, value in extra.items():
        if key in fields and fields[key] != value:
            raise OmniAPIError(
                f"{key} is given twice with different values (at the top level and in {where})", param=key
            )
        fields[key] = value


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise OmniAPIError(f"{where} must be an object", param=where)
    return value


def _image_url(item: Any) -> Any:
    """A data URI, or OpenAI's ``{"image_url": "..."}`` / ``{"image_url": {"url": "..."}}``."""
    if isinstance(item, dict):
        item = item.get("image_url")
        if isinstance(item, dict):
            item = item.get("url")
    return item
