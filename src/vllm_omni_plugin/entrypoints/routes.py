"""The omni server's HTTP routes: the OpenAI Images API, its Videos API (jobs: ``video_calls``), chat
completions with image output, models, health and generated media. Each route reads its body (JSON, or a
multipart form), parses it (``image_protocol``, ``video_protocol``, ``chat_protocol``, ``models_protocol``)
and hands it to ``api_calls`` (``video_calls``), which checks it, builds its requests and encodes the answer
as every front end does; the serving state (``OmniServer``) runs it. A client mistake is an
``OmniAPIError``.
"""

from __future__ import annotations

import asyncio
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
from fastapi.responses import FileResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from vllm_omni_plugin.diffusion.lora import LoraError
from vllm_omni_plugin.entrypoints.api_calls import (
    chat_body,
    chat_call,
    edit_call,
    generation_call,
    images_body,
    variation_call,
)
from vllm_omni_plugin.entrypoints.chat_protocol import ChatCompletionRequest
from vllm_omni_plugin.entrypoints.errors import OmniAPIError, decode_json, error_body, parse_request
from vllm_omni_plugin.entrypoints.image_codec import MEDIA_TYPES, decode_image, decode_mask
from vllm_omni_plugin.entrypoints.image_protocol import (
    ImageEditRequest,
    ImageGenerationRequest,
    ImageLimits,
    ImageVariationRequest,
)
from vllm_omni_plugin.entrypoints.lora_adapters import RUNTIME_UPDATES_ENV, runtime_updates_allowed
from vllm_omni_plugin.entrypoints.models_protocol import (
    LoadLoraRequest,
    ModelCard,
    ModelList,
    UnloadLoraRequest,
)
from vllm_omni_plugin.entrypoints.omni_server import OmniServer, disconnected, http_status
from vllm_omni_plugin.entrypoints.streaming import chat_events, image_events
from vllm_omni_plugin.entrypoints.video_calls import VideoService, read_reference
from vllm_omni_plugin.entrypoints.video_protocol import VideoCreateRequest
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.input_work import input_work

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
    call = await generation_call(server, req)
    if call.stream:
        return _events(image_events(server, call, disconnected(raw)))
    results = await server.run(call.endpoint, call.requests, disconnected(raw))
    return _json(await images_body(call, results, _media_saver(server, raw)))


@router.post("/v1/images/edits")
async def edit_images(raw: Request) -> Response:
    return await _edit_or_variation(raw, "images/edits", ImageEditRequest)


@router.post("/v1/images/variations")
async def image_variations(raw: Request) -> Response:
    return await _edit_or_variation(raw, "images/variations", ImageVariationRequest)


async def _edit_or_variation(raw: Request, endpoint: str, request_type: type[ImageEditRequest]) -> Response:
    """An edit (images, a prompt, an optional mask) or a variation (one image, no prompt): both read the
    same multipart form and run as image-to-image (or inpainting) requests."""
    server = _server(raw)
    limits = server.limits
    server.check_image_input(1, endpoint, "image")  # before reading the body
    form = await _read_form(raw, limits)
    try:
        files, mask, fields = _edit_parts(form, limits, endpoint)
        req = parse_request(request_type, fields)

        async def read(upload: UploadFile, param: str) -> bytes:
            if upload.size is not None and upload.size > limits.max_upload_bytes:
                raise OmniAPIError(
                    f"{param}: {_file_label(upload)} is {upload.size} bytes; this server accepts at most "
                    f"{limits.max_upload_bytes} bytes per image",
                    status=413,
                    param=param,
                )
            return await upload.read()

        async def read_images() -> list[Any]:
            images = []
            for upload in files:
                blob = await read(upload, "image")
                images.append(await asyncio.to_thread(decode_image, blob, limits, "image", upload.filename))
            return images

        async def read_mask(size: tuple[int, int]) -> Any:
            assert mask is not None
            blob = await read(mask, "mask")
            return await asyncio.to_thread(decode_mask, blob, limits, size, "mask", mask.filename)

        if isinstance(req, ImageVariationRequest):
            call = await variation_call(server, req, read_images, disconnected(raw))
        else:
            reads_mask = read_mask if mask is not None else None
            call = await edit_call(server, req, read_images, read_mask=reads_mask)
    finally:
        await form.close()
    if call.stream:
        return _events(image_events(server, call, disconnected(raw)))
    results = await server.run(call.endpoint, call.requests, disconnected(raw))
    return _json(await images_body(call, results, _media_saver(server, raw)))


@router.post("/v1/chat/completions")
async def chat_completions(raw: Request) -> Response:
    server = _server(raw)
    req = parse_request(ChatCompletionRequest, await _read_json(raw, _json_limit(server.limits)))
    call = await chat_call(server, req)
    if call.stream:
        return _events(chat_events(server, call, disconnected(raw)))
    results = await server.run(call.endpoint, call.requests, disconnected(raw))
    return _json(await chat_body(call, results))


@router.get("/v1/models")
async def list_models(raw: Request) -> Response:
    server = _server(raw)
    created = int(time.time())
    root = server.omni.deployment.model
    names = server.settings.served_model_names
    cards = [ModelCard(id=n, created=created, root=root) for n in names]
    cards += [
        ModelCard(id=name, created=created, root=path, parent=names[0])
        for name, path in sorted(server.adapters.names.items())
    ]
    return _json(ModelList(data=cards))


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(raw: Request) -> Response:
    server = _server(raw)
    _runtime_lora_updates()
    req = parse_request(LoadLoraRequest, await _read_json(raw, 1 << 20))
    try:
        await input_work(server.adapters.check, req.lora_name, req.lora_path)
    except LoraError as exc:
        raise OmniAPIError(str(exc), param="lora_path") from None
    server.adapters.add(req.lora_name, req.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(raw: Request) -> Response:
    server = _server(raw)
    _runtime_lora_updates()
    req = parse_request(UnloadLoraRequest, await _read_json(raw, 1 << 20))
    server.adapters.remove(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def _runtime_lora_updates() -> None:
    if not runtime_updates_allowed():
        raise OmniAPIError(
            f"loading and unloading LoRA adapters at run time is off: start the server with "
            f"{RUNTIME_UPDATES_ENV}=True (adapters named with --lora-modules are served)",
            status=404,
        )


@router.post("/v1/videos")
async def create_video(raw: Request) -> Response:
    """A video job (OpenAI's Videos API): JSON, or the multipart form the openai client always sends (its
    ``input_reference`` a file part); answered at once with the queued job."""
    server = _server(raw)
    videos = _videos(server)
    limits = server.limits
    if _media_type(raw) == "multipart/form-data":
        form = await _read_form(raw, limits)
        try:
            upload, fields = _video_parts(form)
            req = parse_request(VideoCreateRequest, fields)

            async def reference() -> Any:
                assert upload is not None
                blob = await upload.read()
                return await asyncio.to_thread(read_reference, server, blob, upload.filename)

            job = await videos.create(req, reference if upload is not None else None)
        finally:
            await form.close()
    else:
        req = parse_request(VideoCreateRequest, await _read_json(raw, _json_limit(limits)))
        job = await videos.create(req, None)
    return _json(job.video())


@router.get("/v1/videos")
async def list_videos(raw: Request) -> Response:
    query = raw.query_params
    limit = query.get("limit")
    if limit is not None and not limit.strip().lstrip("-").isdigit():
        raise OmniAPIError(f"limit must be a whole number, got {limit!r}", param="limit")
    page = _videos(_server(raw)).store.list(
        after=query.get("after") or None,
        limit=int(limit) if limit is not None else 20,
        order=query.get("order") or "desc",
    )
    return _json(page)


@router.get("/v1/videos/{video_id}")
async def retrieve_video(video_id: str, raw: Request) -> Response:
    return _json(_videos(_server(raw)).store.get(video_id).video())


@router.get("/v1/videos/{video_id}/content")
async def video_content(video_id: str, raw: Request) -> Response:
    variant = raw.query_params.get("variant") or "video"
    if variant != "video":
        raise OmniAPIError(
            f"variant {variant!r} is not available: this server keeps the video only (variant=video)",
            param="variant",
        )
    path = _videos(_server(raw)).store.content_path(video_id)
    return FileResponse(path, media_type="video/mp4", filename=f"{video_id}.mp4")


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, raw: Request) -> Response:
    _videos(_server(raw)).delete(video_id)
    return _json({"id": video_id, "object": "video.deleted", "deleted": True})


def _videos(server: OmniServer) -> VideoService:
    """The Videos API's service; a server whose model makes images has none (400 naming the way)."""
    if server.videos is None:
        label = server.omni.inputs.model_label
        raise OmniAPIError(
            f"videos: this model ({label}) makes images, not videos: use /v1/images/generations",
            param="model",
        )
    return server.videos


def _video_parts(form: FormData) -> tuple[UploadFile | None, dict[str, Any]]:
    """The video form's ``input_reference`` file (if any) and its other fields, each sent once."""
    upload: UploadFile | None = None
    fields: dict[str, Any] = {}
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if key != "input_reference":
                raise OmniAPIError(
                    f"{key}: file uploads other than input_reference are not supported", param=key
                )
            if upload is not None:
                raise OmniAPIError("input_reference is repeated: send one image", param="input_reference")
            upload = value
        elif key in fields:
            raise OmniAPIError(f"{key} is repeated: send it once", param=key)
        else:
            fields[key] = _form_value(key, value)
    if upload is not None:
        fields["input_reference"] = b""  # read (and checked) once the request's fields are
    return upload, fields


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


def _events(events: AsyncIterator[bytes]) -> Response:
    """A streamed answer: server-sent events, not buffered by proxies."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


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
            f"{raw.url.path} takes a multipart/form-data body (the files and form fields), {sent}",
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


def _edit_parts(
    form: FormData, limits: ImageLimits, endpoint: str
) -> tuple[list[UploadFile], UploadFile | None, dict[str, Any]]:
    """The edit's image files, its mask file (edits only) and its other fields, each sent once (a
    repeated field is refused, not one of its values picked)."""
    files: list[UploadFile] = []
    mask: UploadFile | None = None
    fields: dict[str, Any] = {}
    takes_mask = endpoint == "images/edits"
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if key == "mask" and takes_mask:
                if mask is not None:
                    raise OmniAPIError("mask is repeated: send one mask file", param="mask")
                mask = value
                continue
            if key not in IMAGE_FIELDS:
                taken = "image and mask" if takes_mask else "image"
                raise OmniAPIError(f"{key}: file uploads other than {taken} are not supported", param=key)
            files.append(value)
        elif key in IMAGE_FIELDS or (key == "mask" and takes_mask):
            raise OmniAPIError(f"{key} must be an uploaded file (a form part with a filename)", param=key)
        elif key in fields:
            raise OmniAPIError(f"{key} is repeated: send it once", param=key)
        else:
            fields[key] = _form_value(key, value)
    if not files:
        raise OmniAPIError("upload at least one image (form field `image`)", param="image")
    if not takes_mask and len(files) > 1:
        raise OmniAPIError(f"{endpoint} takes one image, not {len(files)}", param="image")
    if len(files) > limits.max_input_images:
        raise OmniAPIError(
            f"too many files: this server takes at most {limits.max_input_images} images per request",
            param="image",
        )
    return files, mask, fields


def _file_label(upload: UploadFile) -> str:
    return repr(upload.filename) if upload.filename else "the upload"


def _form_value(key: str, value: str) -> Any:
    """A form field as the request types read it. A form carries only text: a field beyond the request
    type's own (a family setting) whose value is a JSON array or object is that value (BAGEL's
    ``cfg_interval=[0.4, 1.0]``)."""
    if key in ImageEditRequest.model_fields or not value.lstrip().startswith(("[", "{")):
        return value
    return decode_json(value, key, param=key)


def _json_limit(limits: ImageLimits) -> int:
    """Room for every allowed input image as base64 plus the rest of a request."""
    return limits.max_input_images * (limits.max_upload_bytes * 4 // 3 + 4) + 1024 * 1024


def _write_file(path: str, blob: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)


def _media_saver(server: OmniServer, raw: Request) -> Callable[[bytes, str], Awaitable[str]] | None:
    """Where ``response_format=url`` images go: the media directory, served at ``/media/...``."""
    media_dir = server.settings.media_dir
    if not media_dir:
        return None

    async def save(blob: bytes, output_format: str) -> str:
        name = f"{uuid.uuid4().hex}.{output_format}"
        await asyncio.to_thread(_write_file, os.path.join(media_dir, name), blob)
        return str(raw.url_for("omni_media", name=name))

    return save
