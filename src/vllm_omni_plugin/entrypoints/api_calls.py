"""One API call, whichever front end read it: our HTTP routes (``routes``) and the Dynamo worker
(``vllm_omni_plugin.dynamo``) both hand a parsed request here, so both apply the same request checks in
the same order, build the same ``OmniRequest``s and answer with the same response body.

A front end reads its transport (a JSON body, a multipart form, Dynamo's request dict), parses it into
the request types of ``image_protocol`` and ``chat_protocol``, calls the ``*_call`` function of its
endpoint, runs the call's requests through ``OmniServer.run`` and turns the results into the body with
``images_body`` or ``chat_body``. A call parses: what a request leaves unset and whether the model can
make it are the runtime's input processor's (``OmniServer.prepare``). Every client mistake is an
``OmniAPIError``.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vllm_omni_plugin.diffusion.lora import LoraSpec
from vllm_omni_plugin.entrypoints.chat_protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatUsage,
    chat_prompt_and_images,
    image_content,
)
from vllm_omni_plugin.entrypoints.errors import OmniAPIError
from vllm_omni_plugin.entrypoints.image_codec import data_uri, encode_image
from vllm_omni_plugin.entrypoints.image_protocol import (
    ImageEditRequest,
    ImageGenerationRequest,
    ImageObject,
    ImagesResponse,
    ImageVariationRequest,
    parse_size,
)
from vllm_omni_plugin.entrypoints.omni_server import OmniServer
from vllm_omni_plugin.stage.input_processor import OmniCoreRequest, OmniRequest
from vllm_omni_plugin.stage.orchestrator import OmniResult


@dataclass
class ApiCall:
    """What one API call runs (its ``n`` requests) and how its answer is encoded."""

    endpoint: str
    """``images/generations``, ``images/edits`` or ``chat/completions`` (metrics and logs)."""
    requests: list[OmniCoreRequest]
    model: str = ""
    response_format: str = "b64_json"
    output_format: str = "png"
    compression: int | None = None
    text: bool = False
    """A chat call answered in text (the pipeline's AR stage), not with an image."""
    stream: bool = False
    """Answered as server-sent events (``streaming``)."""
    revised_prompt: str | None = None
    """The prompt the images were drawn from where the server wrote it (a variation's description)."""


def check_stream(req: Any) -> bool:
    """Whether the call streams; a stream carries one image (or answer)."""
    if req.stream and req.n > 1:
        raise OmniAPIError("stream answers with one image: send n=1 (or several requests)", param="n")
    return bool(req.stream)


async def generation_call(server: OmniServer, req: ImageGenerationRequest) -> ApiCall:
    """``POST /v1/images/generations``."""
    server.check_model(req.model)
    lora = server.check_lora(req.lora, req.model)
    server.check_prompts(req.prompt, req.negative_prompt)
    settings = server.check_settings(req)
    server.check_image_input(0, "images/generations", "prompt")
    response_format = server.check_response_format(req.response_format)
    size = parse_size(req.size)
    server.check_steps(req.num_inference_steps)
    parsed = image_requests(req, req.prompt, size, settings, lora=lora)
    requests = await server.prepare(parsed, {"size": "size", "source": "prompt"})
    return images_call("images/generations", req, requests, response_format)


async def edit_call(
    server: OmniServer,
    req: ImageEditRequest,
    read_images: Callable[[], Awaitable[list[Any]]],
    image_param: str = "image",
    read_mask: Callable[[tuple[int, int]], Awaitable[Any]] | None = None,
    endpoint: str = "images/edits",
) -> ApiCall:
    """``POST /v1/images/edits`` (and ``/v1/images/variations``, an edit without a prompt):
    ``read_images`` decodes the source images (uint8 HxWx3, at most the limits' ``max_input_images``: the
    front end bounds them as it reads), after the request's own fields are checked; ``read_mask`` decodes
    the mask of the first image (its (height, width) given), where one was sent."""
    server.check_image_input(1, endpoint, image_param)
    if read_mask is not None:
        server.check_mask_input(endpoint)
    server.check_model(req.model)
    lora = server.check_lora(req.lora, req.model)
    server.check_prompts(req.prompt, req.negative_prompt)
    settings = server.check_settings(req)
    response_format = server.check_response_format(req.response_format)
    size = parse_size(req.size)
    images = await read_images()
    mask = None
    if read_mask is not None:
        if len(images) != 1:
            raise OmniAPIError(
                f"a mask marks one image: send one image with it, not {len(images)}", param="mask"
            )
        mask = await read_mask(images[0].shape[:2])
    server.check_steps(req.num_inference_steps)
    parsed = image_requests(req, req.prompt, size, settings, images, lora=lora)
    for request in parsed:
        request.mask, request.strength = mask, req.strength
    requests = await server.prepare(parsed, {"size": "size", "source": image_param, "mask": "mask"})
    return images_call(endpoint, req, requests, response_format)


DESCRIBE_PROMPT = "Describe this image in detail: its subject, setting, composition, colors and style."
"""What a pipeline that understands images (BAGEL's thinker) is asked before it draws a variation."""
DESCRIPTION_TOKENS = 96


async def variation_call(
    server: OmniServer,
    req: ImageVariationRequest,
    read_images: Callable[[], Awaitable[list[Any]]],
    gone: Awaitable[Any],
) -> ApiCall:
    """``POST /v1/images/variations``: where the pipeline understands images (it answers in text: BAGEL),
    its own description of the image (greedy) drives a generation of the image's size, the description
    returned as the images' ``revised_prompt``; elsewhere, and where the request gives a ``prompt``, an
    image-to-image of the source (an edit without a prompt)."""
    endpoint = "images/variations"
    if not server.settings.answers_in_text or req.prompt:
        return await edit_call(server, req, read_images, endpoint=endpoint)
    server.check_image_input(1, endpoint, "image")
    server.check_model(req.model)
    lora = server.check_lora(req.lora, req.model)
    settings = server.check_settings(req)
    response_format = server.check_response_format(req.response_format)
    size = parse_size(req.size)
    server.check_steps(req.num_inference_steps)
    images = await read_images()
    ask = OmniRequest(
        prompt=DESCRIBE_PROMPT,
        images=list(images),
        modality="text",
        sampling_params={"temperature": 0.0, "max_tokens": DESCRIPTION_TOKENS},
        priority=req.priority,
        strength=req.strength,  # refused here (the input processor) as by an edit, before the thinker runs
    )
    [answer] = await server.run(endpoint, await server.prepare([ask], {"source": "image"}), gone)
    description = (answer.output.text or "").strip()
    if not description:
        raise OmniAPIError("the model described the image with no text: nothing to draw", status=500)
    height, width = images[0].shape[:2]
    parsed = image_requests(req, description, size or (width, height), settings, lora=lora)
    requests = await server.prepare(parsed, {"size": "size", "source": "image"})
    call = images_call(endpoint, req, requests, response_format)
    call.revised_prompt = description
    return call


def images_call(
    endpoint: str, req: ImageGenerationRequest, requests: list[OmniCoreRequest], response_format: str
) -> ApiCall:
    """An Images API call (generations, edits) of its checked requests, encoded as the request asks."""
    return ApiCall(
        endpoint,
        requests,
        response_format=response_format,
        output_format=req.output_format or "png",
        compression=req.output_compression,
        stream=check_stream(req),
    )


async def chat_call(server: OmniServer, req: ChatCompletionRequest) -> ApiCall:
    """``POST /v1/chat/completions``: an image answer (``"modalities": ["image"]``), else a text answer
    where the pipeline can give one."""
    if not req.wants_image and not server.settings.answers_in_text:
        raise OmniAPIError(
            f"this deployment ({server.settings.pipeline}) generates images and cannot answer in "
            'text: send "modalities": ["image"]',
            param="modalities",
        )
    model = server.check_model(req.model)
    lora = server.check_lora(req.lora, req.model)
    settings = server.check_settings(req)
    server.check_steps(req.num_inference_steps)
    prompt, images, mask = await asyncio.to_thread(chat_prompt_and_images, req.messages, server.limits)
    server.check_prompts(prompt, req.negative_prompt, param="messages")
    if not req.wants_image:
        parsed = [
            OmniRequest(
                prompt=prompt,
                images=list(images),
                seed=seed,
                modality="text",
                sampling_params=req.sampling_params(),
                generation_params=dict(settings),
                priority=req.priority,
            )
            for seed in seeds(req.seed, req.n)
        ]
        requests = await server.prepare(parsed, {"source": "messages"})
        return ApiCall("chat/completions", requests, model=model, text=True, stream=check_stream(req))
    server.check_image_input(len(images), "chat/completions", "messages")
    if mask is not None:
        server.check_mask_input("chat/completions")
    size = parse_size(req.size)
    sides = (req.width, req.height) if size is None else size
    parsed = image_requests(req, prompt, sides, settings, images, req.sampling_params(), lora=lora)
    for request in parsed:
        request.mask = mask
    size_param = (
        "size" if size is not None else "width" if req.height is None and req.width is not None else "height"
    )
    requests = await server.prepare(parsed, {"size": size_param, "source": "messages"})
    return ApiCall(
        "chat/completions",
        requests,
        model=model,
        output_format=req.output_format or "png",
        stream=check_stream(req),
    )


async def encode_all(results: list[OmniResult], output_format: str, compression: int | None) -> list[bytes]:
    return list(
        await asyncio.gather(
            *(asyncio.to_thread(encode_image, r.output.image, output_format, compression) for r in results)
        )
    )


async def images_body(
    call: ApiCall,
    results: list[OmniResult],
    save_media: Callable[[bytes, str], Awaitable[str]] | None = None,
) -> ImagesResponse:
    """The Images API answer. ``save_media(blob, output_format)`` stores an image and says its URL (for
    ``response_format=url``, which only a front end that serves media offers)."""
    encoded = await encode_all(results, call.output_format, call.compression)
    if call.response_format == "url":
        assert save_media is not None, "response_format=url is refused where no media is served"
        data = [
            ImageObject(url=await save_media(blob, call.output_format), revised_prompt=call.revised_prompt)
            for blob in encoded
        ]
    else:
        data = [
            ImageObject(b64_json=base64.b64encode(blob).decode("ascii"), revised_prompt=call.revised_prompt)
            for blob in encoded
        ]
    height, width = results[0].output.image.shape[:2]  # a pipeline may keep an edit's source size (BAGEL)
    return ImagesResponse(
        created=int(time.time()),
        data=data,
        output_format=call.output_format,
        size=f"{width}x{height}",
        background="opaque",
    )


async def chat_body(call: ApiCall, results: list[OmniResult]) -> ChatCompletionResponse:
    """The chat completion: the images as content parts (with the model's text after them, when it wrote
    some), or the text answer with its token usage."""
    if call.text:
        choices = [
            ChatChoice(
                index=i,
                message=ChatMessage(role="assistant", content=r.output.text or ""),
                finish_reason="length" if r.output.finish_reason == "length" else "stop",
            )
            for i, r in enumerate(results)
        ]
        prompt_tokens = sum(r.output.num_prompt_tokens for r in results)
        completion_tokens = sum(len(r.output.token_ids) for r in results)
        usage: ChatUsage | None = ChatUsage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
    else:
        encoded = await encode_all(results, call.output_format, None)
        choices = [
            ChatChoice(
                index=i,
                message=ChatMessage(
                    role="assistant",
                    content=image_content(data_uri(blob, call.output_format), result.notes.get("think_text")),
                ),
            )
            for i, (blob, result) in enumerate(zip(encoded, results, strict=True))
        ]
        usage = None
    return ChatCompletionResponse(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=call.model,
        choices=choices,
        usage=usage,
    )


def seeds(seed: int | None, n: int) -> list[int | None]:
    if seed is None:
        return [None] * n
    return [(seed + i) % 2**63 for i in range(n)]


def image_requests(
    req: Any,
    prompt: str,
    size: tuple[int | None, int | None] | None,
    settings: dict[str, Any],
    images: list[Any] | tuple[Any, ...] = (),
    sampling_params: dict[str, Any] | None = None,
    *,
    lora: LoraSpec | None = None,
) -> list[OmniRequest]:
    """The ``n`` requests of one API call (every image route): one per seed, the rest shared; ``size``:
    (width, height) as the client gave them (None: neither); the family's settings
    (``OmniServer.check_settings``) travel as its generation parameters."""
    width, height = size or (None, None)
    return [
        OmniRequest(
            prompt=prompt,
            height=height,
            width=width,
            num_inference_steps=req.num_inference_steps,
            guidance_scale=req.guidance_scale,
            seed=seed,
            negative_prompt=req.negative_prompt,
            images=list(images),
            sampling_params=dict(sampling_params or {}),
            generation_params=dict(settings),
            partial_images=getattr(req, "partial_images", 0) if req.stream else 0,
            lora=lora,
            cache=req.cache,
            priority=req.priority,
        )
        for seed in seeds(req.seed, req.n)
    ]
