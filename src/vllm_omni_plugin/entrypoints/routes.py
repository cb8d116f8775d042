"""The omni server's HTTP routes: the OpenAI Images API, chat completions with image output, models,
health and generated media. Each route validates its request (``openai_images``), asks the serving
state (``OmniServer``) to run it and encodes the images; a client mistake is an ``OmniAPIError``.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import time
import uuid
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from starlette.datastructures import UploadFile

from vllm_omni_plugin.entrypoints.omni_server import OmniServer
from vllm_omni_plugin.entrypoints.openai_images import (
    MEDIA_TYPES,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatUsage,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageLimits,
    ImageObject,
    ImagesResponse,
    ModelCard,
    ModelList,
    OmniAPIError,
    chat_prompt_and_images,
    data_uri,
    decode_image,
    encode_image,
    error_body,
    fit_to_grid,
    image_content,
    parse_request,
    parse_size,
)
from vllm_omni_plugin.stage.orchestrator import OmniRequest, OmniResult

MEDIA_NAME = re.compile(r"^[0-9a-f]{32}\.(png|jpeg|webp)$")

router = APIRouter()


@router.post("/v1/images/generations")
async def create_images(raw: Request) -> Response:
    server = _server(raw)
    req = parse_request(ImageGenerationRequest, await _read_json(raw, _json_limit(server.limits)))
    server.check_model(req.model)
    settings = server.check_settings(req)
    server.check_image_input(0, "images/generations", "prompt")
    response_format = _check_response_format(server, req.response_format)
    size = parse_size(req.size, server.limits)
    width, height = size or (server.limits.default_width, server.limits.default_height)
    server.check_size(width, height)
    server.check_ar_tokens(req.prompt, [], width, height)
    server.check_steps(req.num_inference_steps)
    requests = _image_requests(req, req.prompt, width, height, settings)
    results = await server.run("images/generations", requests, raw)
    return await _images_response(
        server, raw, results, response_format=response_format, output_format=req.output_format or "png",
        compression=req.output_compression, width=width, height=height,
    )  # fmt: skip


@router.post("/v1/images/edits")
async def edit_images(raw: Request) -> Response:
    server = _server(raw)
    limits = server.limits
    server.check_image_input(1, "images/edits", "image")
    if not raw.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise OmniAPIError("images/edits takes a multipart/form-data body (the image files and form fields)")
    length = raw.headers.get("content-length")
    max_body = limits.max_upload_bytes * limits.max_input_images + 1024 * 1024
    if length is not None and length.isdigit() and int(length) > max_body:
        raise OmniAPIError(
            f"the upload is {length} bytes; this server accepts at most {limits.max_upload_bytes} bytes per "
            f"image and {limits.max_input_images} images",
            param="image",
        )
    try:
        form = await raw.form(max_files=limits.max_input_images + 1, max_fields=64)
    except Exception as exc:  # starlette's MultiPartException and parser errors
        raise OmniAPIError(f"malformed multipart body: {exc}") from None
    try:
        files: list[UploadFile] = []
        fields: dict[str, Any] = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key not in ("image", "image[]"):
                    raise OmniAPIError(f"{key}: file uploads other than image are not supported", param=key)
                files.append(value)
            elif key in ("image", "image[]"):
                raise OmniAPIError("image must be an uploaded file", param="image")
            else:
                fields[key] = value
        if not files:
            raise OmniAPIError("upload at least one image (form field `image`)", param="image")
        if len(files) > limits.max_input_images:
            raise OmniAPIError(f"at most {limits.max_input_images} images per request", param="image")
        req = parse_request(ImageEditRequest, fields)
        server.check_model(req.model)
        settings = server.check_settings(req)
        response_format = _check_response_format(server, req.response_format)
        size = parse_size(req.size, limits)
        images = []
        for upload in files:
            if upload.size is not None and upload.size > limits.max_upload_bytes:
                raise OmniAPIError(
                    f"image: {upload.filename or 'the upload'} is {upload.size} bytes; this server "
                    f"accepts at most {limits.max_upload_bytes} bytes per image",
                    param="image",
                )
            blob = await upload.read()
            images.append(await asyncio.to_thread(decode_image, blob, limits, "image"))
    finally:
        await form.close()
    width, height = size or fit_to_grid(images[0].shape[1], images[0].shape[0], limits)
    server.check_size(width, height)
    server.check_ar_tokens(req.prompt, images, width, height, source_param="image")
    server.check_steps(req.num_inference_steps)
    requests = _image_requests(req, req.prompt, width, height, settings, images)
    results = await server.run("images/edits", requests, raw)
    height, width = results[0].output.image.shape[:2]  # a pipeline may keep the input's own size (BAGEL)
    return await _images_response(
        server, raw, results, response_format=response_format, output_format=req.output_format or "png",
        compression=req.output_compression, width=width, height=height,
    )  # fmt: skip


@router.post("/v1/chat/completions")
async def chat_completions(raw: Request) -> Response:
    server = _server(raw)
    limits = server.limits
    req = parse_request(ChatCompletionRequest, await _read_json(raw, _json_limit(limits)))
    if not req.wants_image and not server.settings.answers_in_text:
        raise OmniAPIError(
            f"this deployment ({server.settings.pipeline}) generates images and cannot answer in "
            'text: send "modalities": ["image"]',
            param="modalities",
        )
    if req.stream:
        raise OmniAPIError("stream is not supported by this server", param="stream")
    model = server.check_model(req.model)
    settings = server.check_settings(req)
    server.check_steps(req.num_inference_steps)
    prompt, images = await asyncio.to_thread(chat_prompt_and_images, req.messages, limits)
    if not req.wants_image:
        return await _chat_text(server, raw, req, model, prompt, images, settings)
    server.check_image_input(len(images), "chat/completions", "messages")
    size = parse_size(req.size, limits)
    if size is None and (req.height is not None or req.width is not None):
        size = (req.width or limits.default_width, req.height or limits.default_height)
    if size is None and images:
        size = fit_to_grid(images[0].shape[1], images[0].shape[0], limits)
    width, height = size or (limits.default_width, limits.default_height)
    size_param = "size" if req.size else "height"
    server.check_size(width, height, param=size_param)
    server.check_ar_tokens(prompt, images, width, height, size_param=size_param, source_param="messages")
    output_format = req.output_format or "png"
    requests = _image_requests(req, prompt, width, height, settings, images, req.sampling_params())
    results = await server.run("chat/completions", requests, raw)
    encoded = await _encode_all(results, output_format, None)
    choices = [
        ChatChoice(
            index=i,
            message=ChatMessage(
                role="assistant",
                content=image_content(data_uri(blob, output_format), result.notes.get("think_text")),
            ),
        )
        for i, (blob, result) in enumerate(zip(encoded, results, strict=True))
    ]
    return _json(
        ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model, choices=choices
        )
    )


async def _chat_text(
    server: OmniServer,
    raw: Request,
    req: ChatCompletionRequest,
    model: str,
    prompt: str,
    images: list[Any],
    settings: dict[str, Any],
) -> Response:
    """A text answer from the pipeline's AR stage (BAGEL: understanding of the images, or chat)."""
    requests = [
        OmniRequest(
            prompt=prompt,
            images=list(images),
            seed=seed,
            modality="text",
            sampling_params=req.sampling_params(),
            generation_params=dict(settings),
        )
        for seed in _seeds(req.seed, req.n)
    ]
    results = await server.run("chat/completions", requests, raw)
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
    return _json(
        ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model,
            choices=choices,
            usage=ChatUsage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
        )
    )


@router.get("/v1/models")
async def list_models(raw: Request) -> Response:
    server = _server(raw)
    created = int(time.time())
    root = server.omni.deployment.model
    return _json(
        ModelList(
            data=[ModelCard(id=n, created=created, root=root) for n in server.settings.served_model_names]
        )
    )


@router.get("/health")
async def health(raw: Request) -> Response:
    ok, payload = _server(raw).health()
    return _json(payload, status=200 if ok else 503)


@router.get("/media/{name}", name="omni_media")
async def media(name: str, raw: Request) -> Response:
    media_dir = _server(raw).settings.media_dir
    match = MEDIA_NAME.match(name)
    path = os.path.join(media_dir, name) if media_dir and match else None
    if path is None or not os.path.isfile(path):
        raise OmniAPIError(f"no image named {name!r}", status=404)
    return FileResponse(path, media_type=MEDIA_TYPES[match.group(1)] if match else None)


async def api_error_handler(raw: Request, exc: Exception) -> Response:
    assert isinstance(exc, OmniAPIError)
    return Response(
        error_body(exc.message, exc.status, exc.param), status_code=exc.status, media_type="application/json"
    )


# --- helpers -----------------------------------------------------------------------------------


def _server(raw: Request) -> OmniServer:
    return raw.app.state.omni_server


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status_code=status, media_type="application/json")


async def _read_json(raw: Request, max_bytes: int) -> Any:
    length = raw.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise OmniAPIError(f"the request body is larger than this server's limit of {max_bytes} bytes")
    body = await raw.body()
    if len(body) > max_bytes:
        raise OmniAPIError(f"the request body is larger than this server's limit of {max_bytes} bytes")
    if not body.strip():
        raise OmniAPIError("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise OmniAPIError(f"the request body is not valid JSON ({exc})") from None


def _json_limit(limits: ImageLimits) -> int:
    """Room for every allowed input image as base64 plus the rest of a request."""
    return limits.max_input_images * (limits.max_upload_bytes * 4 // 3 + 4) + 1024 * 1024


def _seeds(seed: int | None, n: int) -> list[int | None]:
    if seed is None:
        return [None] * n
    return [(seed + i) % 2**63 for i in range(n)]


async def _encode_all(results: list[OmniResult], output_format: str, compression: int | None) -> list[bytes]:
    return list(
        await asyncio.gather(
            *(asyncio.to_thread(encode_image, r.output.image, output_format, compression) for r in results)
        )
    )


async def _images_response(
    server: OmniServer,
    raw: Request,
    results: list[OmniResult],
    *,
    response_format: str,
    output_format: str,
    compression: int | None,
    width: int,
    height: int,
) -> Response:
    encoded = await _encode_all(results, output_format, compression)
    data: list[ImageObject] = []
    if response_format == "url":
        assert server.settings.media_dir is not None
        for blob in encoded:
            name = f"{uuid.uuid4().hex}.{output_format}"
            path = os.path.join(server.settings.media_dir, name)
            await asyncio.to_thread(_write_file, path, blob)
            data.append(ImageObject(url=str(raw.url_for("omni_media", name=name))))
    else:
        data = [ImageObject(b64_json=base64.b64encode(blob).decode("ascii")) for blob in encoded]
    return _json(
        ImagesResponse(
            created=int(time.time()),
            data=data,
            output_format=output_format,
            size=f"{width}x{height}",
            background="opaque",
        )
    )


def _write_file(path: str, blob: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)


def _check_response_format(server: OmniServer, response_format: str | None) -> str:
    if response_format == "url" and not server.settings.media_dir:
        raise OmniAPIError(
            "response_format=url needs a media directory on the server (--image-media-dir); "
            "use response_format=b64_json",
            param="response_format",
        )
    return response_format or "b64_json"


def _image_requests(
    req: Any,
    prompt: str,
    width: int,
    height: int,
    settings: dict[str, Any],
    images: list[Any] | tuple[Any, ...] = (),
    sampling_params: dict[str, Any] | None = None,
) -> list[OmniRequest]:
    """The ``n`` requests of one API call (every image route): one per seed, the rest shared; the
    family's settings (``OmniServer.check_settings``) travel as its generation parameters."""
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
        )
        for seed in _seeds(req.seed, req.n)
    ]
