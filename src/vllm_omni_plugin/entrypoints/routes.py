"""The omni server's HTTP routes: the OpenAI Images API, chat completions with image output, models,
health and generated media. Each route validates its request (``openai_images``), asks the serving
state (``OmniServer``) to run it and encodes the images; a client mistake is an ``OmniAPIError``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response
from fastapi.routing import APIRoute
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from vllm_omni_plugin.entrypoints.omni_server import OmniServer, http_status
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
    decode_json,
    encode_image,
    error_body,
    fit_to_grid,
    image_content,
    parse_request,
    parse_size,
)
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.orchestrator import OmniRequest, OmniResult

logger = get_logger(__name__)

MEDIA_NAME = re.compile(r"^[0-9a-f]{32}\.(png|jpeg|webp)$")
FORM_MEDIA_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
IMAGE_FIELDS = ("image", "image[]")
MAX_FORM_FIELDS = 64
MAX_FIELD_BYTES = 1024 * 1024
"""The most bytes of one form field that is not a file (a prompt, a setting); images come as files."""
_BOUNDARY = re.compile(r';\s*boundary\s*=\s*("[^"]+"|[^;\s]+)', re.I)


class OmniRoute(APIRoute):
    """Our routes' safety net: an error no check turned into an ``OmniAPIError`` (a bug) is answered here
    as error JSON and logged with its traceback. Left to the app, it would reach Starlette's
    ServerErrorMiddleware, which answers 500 and re-raises, and the HTTP server then drops the connection."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def guarded(raw: Request) -> Response:
            try:
                return await handler(raw)
            except (OmniAPIError, HTTPException, RequestValidationError):
                raise
            except ClientDisconnect:
                raise OmniAPIError("the client disconnected", status=499) from None
            except Exception as exc:
                status = http_status(exc)
                logger.error("%s %s failed (%d)", raw.method, raw.url.path, status, exc_info=exc)
                return _error(f"{type(exc).__name__}: {exc}", status)

        return guarded


router = APIRouter(route_class=OmniRoute)


@router.post("/v1/images/generations")
async def create_images(raw: Request) -> Response:
    server = _server(raw)
    req = parse_request(ImageGenerationRequest, await _read_json(raw, _json_limit(server.limits)))
    server.check_model(req.model)
    server.check_prompts(req.prompt, req.negative_prompt)
    settings = server.check_settings(req)
    server.check_image_input(0, "images/generations", "prompt")
    response_format = _check_response_format(server, req.response_format)
    size = parse_size(req.size, server.limits)
    width, height = size or (server.limits.default_width, server.limits.default_height)
    server.check_size(width, height)
    await server.check_ar_tokens(req.prompt, [], width, height)
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
    form = await _read_form(raw, limits)
    try:
        files, fields = _edit_parts(form, limits)
        req = parse_request(ImageEditRequest, fields)
        server.check_model(req.model)
        server.check_prompts(req.prompt, req.negative_prompt)
        settings = server.check_settings(req)
        response_format = _check_response_format(server, req.response_format)
        size = parse_size(req.size, limits)
        images = []
        for upload in files:
            if upload.size is not None and upload.size > limits.max_upload_bytes:
                raise OmniAPIError(
                    f"image: {_file_label(upload)} is {upload.size} bytes; this server accepts at most "
                    f"{limits.max_upload_bytes} bytes per image",
                    status=413,
                    param="image",
                )
            blob = await upload.read()
            images.append(await asyncio.to_thread(decode_image, blob, limits, "image", upload.filename))
    finally:
        await form.close()
    width, height = size or fit_to_grid(images[0].shape[1], images[0].shape[0], limits)
    server.check_size(width, height)
    await server.check_ar_tokens(req.prompt, images, width, height, source_param="image")
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
    server.check_prompts(prompt, req.negative_prompt, param="messages")
    if not req.wants_image:
        return await _chat_text(server, raw, req, model, prompt, images, settings)
    server.check_image_input(len(images), "chat/completions", "messages")
    width, height, size_param = _chat_size(req, limits, images)
    server.check_size(width, height, param=size_param)
    await server.check_ar_tokens(
        prompt, images, width, height, size_param=size_param, source_param="messages"
    )
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
    return _error(exc.message, exc.status, exc.param)


Handler = Callable[[Request, Any], Awaitable[Response]]


def framework_error_handler(fallback: Handler) -> Handler:
    """FastAPI's and Starlette's own errors (404 no such route, 405 method not allowed, request validation)
    as our error JSON on our paths (``/v1/...``, ``/health``, ``/media/...``); ``fallback`` answers
    elsewhere, so vLLM's own routes answer as in ``vllm serve``."""

    async def handler(raw: Request, exc: Any) -> Response:
        path = raw.url.path
        root = raw.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if not _our_path(path):
            return await fallback(raw, exc)
        if isinstance(exc, RequestValidationError):
            first = exc.errors()[0] if exc.errors() else {}
            param = ".".join(str(p) for p in first.get("loc", ())) or None
            return _error(f"{param}: {first.get('msg', 'invalid value')}", 400, param)
        status = int(getattr(exc, "status_code", 500))
        headers = dict(getattr(exc, "headers", None) or {})
        if status == 404:
            message = f"{raw.method} {path}: this server has no such route; it serves {_served_routes()}"
        elif status == 405:
            allowed = headers.get("Allow") or headers.get("allow") or "another method"
            message = f"{raw.method} is not allowed on {path}; use {allowed}"
        else:
            message = str(getattr(exc, "detail", "") or exc)
        return _error(message, status, headers=headers)

    return handler


def _our_path(path: str) -> bool:
    return path == "/v1" or path.startswith(("/v1/", "/media/")) or path == "/health"


def _served_routes() -> str:
    return ", ".join(
        f"{method} {route.path}"
        for route in router.routes
        if isinstance(route, APIRoute) and route.path.startswith("/v1/")
        for method in sorted(route.methods)
    )


# --- helpers -----------------------------------------------------------------------------------


def _server(raw: Request) -> OmniServer:
    return raw.app.state.omni_server


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status_code=status, media_type="application/json")


def _error(
    message: str, status: int, param: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        error_body(message, status, param), status_code=status, headers=headers, media_type="application/json"
    )


def _media_type(raw: Request) -> str:
    return raw.headers.get("content-type", "").split(";", 1)[0].strip().lower()


async def _read_json(raw: Request, max_bytes: int) -> Any:
    """The JSON body. A form body is refused (415); one without a Content-Type, or ``text/plain`` (curl's
    ``-d`` without ``-H``), is read as JSON."""
    media_type = _media_type(raw)
    if media_type in FORM_MEDIA_TYPES:
        raise OmniAPIError(
            f"{raw.url.path} takes a JSON body: send it as Content-Type: application/json, not {media_type}",
            status=415,
        )
    async with contextlib.aclosing(_body(raw, max_bytes)) as chunks:
        body = b"".join([chunk async for chunk in chunks])
    if not body.strip():
        raise OmniAPIError("the request body is empty; send a JSON object")
    return decode_json(body)


async def _body(raw: Request, max_bytes: int, allowed: str = "") -> AsyncIterator[bytes]:
    """The body as it arrives, held to ``max_bytes`` (413, ``allowed`` says what that allows) and to its
    Content-Length (400): a chunked body has none, and only the ASGI app sees a short one."""
    limit = f"this server accepts at most {max_bytes} bytes{allowed}"
    length = raw.headers.get("content-length")
    declared = None
    if length is not None:
        if not length.strip().isdigit():
            raise OmniAPIError(f"the Content-Length header {length!r} is not a number of bytes")
        declared = int(length)
        if declared > max_bytes:
            raise OmniAPIError(f"the request body is {declared} bytes; {limit}", status=413)
    received = 0
    async for chunk in raw.stream():
        received += len(chunk)
        if received > max_bytes:
            raise OmniAPIError(f"the request body is over {max_bytes} bytes; {limit}", status=413)
        if declared is not None and received > declared:
            raise OmniAPIError(f"the request body is longer than its Content-Length ({declared} bytes)")
        yield chunk
    if declared is not None and received != declared:
        raise OmniAPIError(
            f"the request body ended after {received} bytes; its Content-Length says {declared} bytes"
        )


class _MultiPartParser(MultiPartParser):
    """Starlette's multipart parser, noting whether the body reached its closing boundary (the parser
    itself accepts a truncated body) and naming what overran a limit."""

    ended = False

    def __init__(self, *args: Any, max_images: int, **kwargs: Any) -> None:
        # One file more than images: an unknown file field is named (``_edit_parts``), not counted.
        super().__init__(*args, max_files=max_images + 1, **kwargs)
        self.max_images = max_images

    def on_end(self) -> None:
        self.ended = True

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        try:
            super().on_part_data(data, start, end)
        except MultiPartException:
            name = getattr(getattr(self, "_current_part", None), "field_name", "") or "a form field"
            raise OmniAPIError(
                f"{name}: the form field's value is over {self.max_part_size} bytes, the most this server "
                "reads from a field that is not a file (images go as files)",
                status=413,
                param=name,
            ) from None

    def on_headers_finished(self) -> None:
        try:
            super().on_headers_finished()
        except MultiPartException as exc:
            if getattr(self, "_current_files", 0) > self.max_files:
                raise OmniAPIError(
                    f"too many files: this server takes at most {self.max_images} images per request",
                    param="image",
                ) from None
            if getattr(self, "_current_fields", 0) > self.max_fields:
                raise OmniAPIError(
                    f"too many form fields: this server reads at most {self.max_fields}"
                ) from None
            raise OmniAPIError(f"malformed multipart body: {exc.message}") from None


async def _read_form(raw: Request, limits: ImageLimits) -> FormData:
    """The edit's multipart form, every part checked as it arrives: a body that is no form (415), has no
    boundary, is truncated or malformed (400), or is over a limit (413) is refused naming the problem."""
    content_type = raw.headers.get("content-type", "")
    media_type = _media_type(raw)
    if media_type != "multipart/form-data":
        sent = f"not {media_type}" if media_type else "and this one has no Content-Type"
        raise OmniAPIError(
            f"images/edits takes a multipart/form-data body (the image files and form fields), {sent}",
            status=415,
        )
    if _BOUNDARY.search(content_type) is None:
        raise OmniAPIError(
            f"the Content-Type {content_type!r} has no boundary parameter "
            "(multipart/form-data; boundary=...); let the HTTP client build the form"
        )
    max_body = limits.max_upload_bytes * limits.max_input_images + 1024 * 1024
    allowed = f" ({limits.max_input_images} images of at most {limits.max_upload_bytes} bytes and the fields)"
    async with contextlib.aclosing(_body(raw, max_body, allowed)) as chunks:
        parser = _MultiPartParser(
            raw.headers,
            chunks,
            max_images=limits.max_input_images,
            max_fields=MAX_FORM_FIELDS,
            max_part_size=MAX_FIELD_BYTES,
        )
        try:
            form = await parser.parse()
        except MultiPartException as exc:
            cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
            raise OmniAPIError(f"malformed multipart body: {exc.message}{cause}") from None
    if not parser.ended:
        await form.close()
        raise OmniAPIError("the multipart body is truncated: it ends before its closing boundary")
    return form


def _edit_parts(form: FormData, limits: ImageLimits) -> tuple[list[UploadFile], dict[str, Any]]:
    """The edit's image files and its other fields, each sent once (a repeated field is refused, not
    one of its values picked)."""
    files: list[UploadFile] = []
    fields: dict[str, Any] = {}
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if key not in IMAGE_FIELDS:
                raise OmniAPIError(f"{key}: file uploads other than image are not supported", param=key)
            files.append(value)
        elif key in IMAGE_FIELDS:
            raise OmniAPIError("image must be an uploaded file (a form part with a filename)", param="image")
        elif key in fields:
            raise OmniAPIError(f"{key} is repeated: send it once", param=key)
        else:
            fields[key] = _form_value(key, value)
    if not files:
        raise OmniAPIError("upload at least one image (form field `image`)", param="image")
    if len(files) > limits.max_input_images:
        raise OmniAPIError(
            f"too many files: this server takes at most {limits.max_input_images} images per request",
            param="image",
        )
    return files, fields


def _file_label(upload: UploadFile) -> str:
    return repr(upload.filename) if upload.filename else "the upload"


def _form_value(key: str, value: str) -> Any:
    """A form field as the request types read it. A form carries only text: a field beyond the request
    type's own (a family setting) whose value is a JSON array or object is that value (BAGEL's
    ``cfg_interval=[0.4, 1.0]``)."""
    if key in ImageEditRequest.model_fields or not value.lstrip().startswith(("[", "{")):
        return value
    return decode_json(value, key, param=key)


def _chat_size(req: ChatCompletionRequest, limits: ImageLimits, images: list[Any]) -> tuple[int, int, str]:
    """Width, height and the field that set them: ``size``, else ``width``/``height`` (an absent one is
    the default; 0 is refused like any size off the grid), else the source's aspect, else the default."""
    size = parse_size(req.size, limits)
    if size is not None:
        return size[0], size[1], "size"
    if req.width is None and req.height is None:
        if images:
            return (*fit_to_grid(images[0].shape[1], images[0].shape[0], limits), "height")
        return limits.default_width, limits.default_height, "height"
    for name, side in (("width", req.width), ("height", req.height)):
        if side is None:
            continue
        if side < limits.min_side or side % limits.multiple:
            raise OmniAPIError(
                f"{name} must be a multiple of {limits.multiple} and at least {limits.min_side} pixels, "
                f"got {side}",
                param=name,
            )
        if side > limits.max_side:
            raise OmniAPIError(
                f"{name} must be at most {limits.max_side} pixels on this server, got {side}", param=name
            )
    width = req.width if req.width is not None else limits.default_width
    height = req.height if req.height is not None else limits.default_height
    return width, height, "height" if req.height is not None else "width"


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
