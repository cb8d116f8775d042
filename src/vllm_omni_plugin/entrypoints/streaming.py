"""Streamed answers (``stream: true``) as server-sent events, in OpenAI's formats.

Images API (generations and edits): ``image_generation.partial_image`` / ``image_edit.partial_image`` for
each preview the request asked for (``partial_images``: decoded from the diffusion stage's estimate of
the clean image, at steps spread over its denoising), then ``image_generation.completed`` /
``image_edit.completed`` with the image. Before the DiT starts, an AR stage's progress comes as
``image_generation.progress`` / ``image_edit.progress`` (``{"stage", "tokens", "total"}``: GLM-Image's
prior tokens out of its grid), an event type of ours that OpenAI's clients pass through.

Chat completions: ``chat.completion.chunk`` events: the role, then the answer's text as it is written
(a text answer), or the image as an ``image_url`` content part (then the model's text, if it wrote some),
the finish reason, and ``[DONE]``; an AR stage's progress before an image answer comes as SSE comments.

A failure once the stream has started is an event whose data is OpenAI's error JSON (OpenAI's clients
raise it as an ``APIError``). A client that closes the stream aborts its request in every stage
(``OmniServer.stream``).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgspec

from vllm_omni_plugin.entrypoints.api_calls import ApiCall
from vllm_omni_plugin.entrypoints.chat_protocol import image_content
from vllm_omni_plugin.entrypoints.errors import OmniAPIError, error_body
from vllm_omni_plugin.entrypoints.image_codec import data_uri, encode_image
from vllm_omni_plugin.entrypoints.omni_server import OmniServer
from vllm_omni_plugin.stage.orchestrator import OmniResult
from vllm_omni_plugin.stage.request_events import ARProgress, DenoiseProgress, PreviewImage

EVENT_PREFIX = {"images/generations": "image_generation", "images/edits": "image_edit"}


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event (``data`` a JSON-able value, or raw bytes)."""
    payload = data if isinstance(data, bytes) else msgspec.json.encode(data)
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + payload + b"\n\n"


def error_event(exc: OmniAPIError) -> bytes:
    return sse(error_body(exc.message, exc.status, exc.param), "error")


async def _encoded(image: Any, output_format: str, compression: int | None) -> str:
    blob = await asyncio.to_thread(encode_image, image, output_format, compression)
    return base64.b64encode(blob).decode("ascii")


async def image_events(
    server: OmniServer, call: ApiCall, gone: Awaitable[Any] | None = None
) -> AsyncIterator[bytes]:
    """The Images API's stream of one request (``n`` is 1 when streaming)."""
    prefix = EVENT_PREFIX[call.endpoint]
    (request,) = call.requests

    def image_fields(image: Any) -> dict[str, Any]:
        height, width = image.shape[:2]
        return {"created_at": int(time.time()), "size": f"{width}x{height}", "quality": "auto",
                "background": "opaque", "output_format": call.output_format}  # fmt: skip

    try:
        async for item in server.stream(call.endpoint, request, gone):
            if isinstance(item, ARProgress):
                progress = {"type": f"{prefix}.progress", "stage": item.stage_id, "tokens": item.tokens,
                            "total": item.total, "created_at": int(time.time())}  # fmt: skip
                yield sse(progress, f"{prefix}.progress")
            elif isinstance(item, PreviewImage):
                b64 = await _encoded(item.image, call.output_format, call.compression)
                partial = {"type": f"{prefix}.partial_image", "b64_json": b64,
                           "partial_image_index": item.index, **image_fields(item.image)}  # fmt: skip
                yield sse(partial, f"{prefix}.partial_image")
            elif isinstance(item, DenoiseProgress):
                continue  # the Images API's stream has no step events
            else:
                image = item.output.image
                b64 = await _encoded(image, call.output_format, call.compression)
                completed = {"type": f"{prefix}.completed", "b64_json": b64, **image_fields(image)}
                yield sse(completed, f"{prefix}.completed")
    except OmniAPIError as exc:
        yield error_event(exc)


async def chat_events(
    server: OmniServer, call: ApiCall, gone: Awaitable[Any] | None = None
) -> AsyncIterator[bytes]:
    """Chat completion chunks of one request (``n`` is 1 when streaming)."""
    (request,) = call.requests
    identity = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": call.model}  # fmt: skip

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return sse({**identity, "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    written = ""
    try:
        async for item in server.stream(call.endpoint, request, gone):
            if isinstance(item, ARProgress):
                if call.text and item.text is not None and len(item.text) > len(written):
                    yield chunk({"content": item.text[len(written) :]})
                    written = item.text
                elif not call.text:
                    yield f": progress stage {item.stage_id} {item.tokens}/{item.total}\n\n".encode()
            elif isinstance(item, OmniResult):
                yield await _final_chunk(call, item, written, chunk)
                finish = "length" if call.text and item.output.finish_reason == "length" else "stop"
                yield chunk({}, finish)
    except OmniAPIError as exc:
        yield error_event(exc)
        return
    yield b"data: [DONE]\n\n"


async def _final_chunk(call: ApiCall, result: OmniResult, written: str, chunk: Any) -> bytes:
    """What is left of the answer once the request is done: the rest of a text answer, or the image (with
    the model's text after it)."""
    if call.text:
        text = result.output.text or ""
        return chunk({"content": text[len(written) :]}) if len(text) > len(written) else b""
    blob = await asyncio.to_thread(encode_image, result.output.image, call.output_format, None)
    return chunk(
        {"content": image_content(data_uri(blob, call.output_format), result.notes.get("think_text"))}
    )
