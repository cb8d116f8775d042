"""The omni API server: vLLM's own FastAPI app with the image routes of an omni pipeline on top.

The app comes from vLLM's ``build_app`` (through ``compat``) so ``--api-key``, CORS, ``--middleware``,
request-id headers, the Prometheus HTTP instrumentation and uvicorn's logging behave as in ``vllm
serve``. vLLM's own routes that need its text-serving state (which an omni deployment does not set up)
or that ours replace are removed; ``/metrics``, ``/version`` and the docs stay. It is served by vLLM's
``serve_http`` on the socket ``setup_server`` bound before any stage started (so a busy port fails
fast). SIGINT/SIGTERM: stop accepting, let in-flight requests finish (up to the drain timeout), stop
every stage, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import re
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, Response
from starlette.datastructures import UploadFile

from vllm_omni_plugin import compat
from vllm_omni_plugin.config import ResolvedDeployment
from vllm_omni_plugin.entrypoints.omni import AsyncOmni
from vllm_omni_plugin.entrypoints.openai_images import (
    MEDIA_TYPES,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageLimits,
    ImageObject,
    ImagesResponse,
    ModelCard,
    ModelList,
    OmniAPIError,
    chat_prompt_and_images,
    check_dimensions,
    data_uri,
    decode_image,
    encode_image,
    error_body,
    fit_to_grid,
    parse_request,
    parse_size,
)
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.errors import RequestAbortedError, StageDeadError, StageStartError
from vllm_omni_plugin.stage.orchestrator import OmniRequest, OmniResult

logger = get_logger(__name__)

# vLLM routes that work without an engine client and that we do not replace.
KEEP_VLLM_PATHS = frozenset(
    {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/version", "/metrics"}
)
DEFAULT_DRAIN_S = 30.0
"""How long SIGINT/SIGTERM waits for in-flight requests when ``--shutdown-timeout`` is 0 (vLLM's
default): an image request cannot be answered half-way, so we drain rather than abort."""
SIZE_MULTIPLE = {"glm_image": 32}
# The AR stage's token budget per image, by pipeline: (height, width, image_to_image) -> tokens.
AR_TOKEN_BUDGET = {"glm_image": "vllm_omni_plugin.stage.processors.glm_image.glm_image_max_new_tokens"}
MEDIA_NAME = re.compile(r"^[0-9a-f]{32}\.(png|jpeg|webp)$")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


# --- settings ----------------------------------------------------------------------------------


@dataclass
class ServerSettings:
    served_model_names: list[str]
    limits: ImageLimits
    media_dir: str | None = None
    ar_max_model_len: int | None = None
    token_budget: Any = None
    """``f(height, width, image_to_image) -> AR tokens`` of the pipeline, when it has an AR stage."""


def settings_from_args(args: argparse.Namespace, deployment: ResolvedDeployment) -> ServerSettings:
    names = list(getattr(args, "served_model_name", None) or []) or [args.model]
    dit = next((s for s in deployment.stages if s.execution_type == "diffusion"), None)
    defaults = dit.diffusion_args if dit is not None else {}
    limits = ImageLimits(
        multiple=SIZE_MULTIPLE.get(deployment.pipeline, 16),
        max_side=int(getattr(args, "image_max_size", None) or ImageLimits.max_side),
        max_upload_bytes=int(getattr(args, "image_max_upload_bytes", None) or ImageLimits.max_upload_bytes),
        default_width=int(defaults.get("width") or ImageLimits.default_width),
        default_height=int(defaults.get("height") or ImageLimits.default_height),
    )
    ar = next((s for s in deployment.stages if s.execution_type == "llm_ar"), None)
    budget = None
    if ar is not None and deployment.pipeline in AR_TOKEN_BUDGET:
        from vllm_omni_plugin.dotted import import_object

        budget = import_object(AR_TOKEN_BUDGET[deployment.pipeline])
    return ServerSettings(
        served_model_names=names,
        limits=limits,
        media_dir=getattr(args, "image_media_dir", None),
        ar_max_model_len=(ar.engine_args.get("max_model_len") if ar is not None else None),
        token_budget=budget,
    )


# --- metrics -----------------------------------------------------------------------------------


class OmniCollector:
    """Per-stage queue depth and health, and connector counters, read from the runtime at scrape time."""

    def __init__(self, omni: AsyncOmni) -> None:
        self.omni = omni

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        depth = GaugeMetricFamily(
            "omni_stage_queue_depth",
            "Requests in flight in each stage (all replicas)",
            labels=["stage", "name"],
        )
        healthy = GaugeMetricFamily(
            "omni_stage_healthy_replicas", "Replicas of each stage ready to serve", labels=["stage", "name"]
        )
        restarts = CounterMetricFamily(
            "omni_stage_replica_restarts",
            "Replica restarts after a stage process died",
            labels=["stage", "name"],
        )
        for sid, pool in self.omni.pools.items():
            labels = [str(sid), pool.name]
            depth.add_metric(labels, pool.queue_depth)
            healthy.add_metric(labels, sum(1 for c in pool.clients if c.healthy))
            restarts.add_metric(labels, sum(c.restarts for c in pool.clients))
        yield from (depth, healthy, restarts)

        moved = CounterMetricFamily(
            "omni_connector_bytes",
            "Bytes put into / got from each connector, and put bytes a receiver confirmed reading",
            labels=["connector", "direction"],
        )
        ops = CounterMetricFamily(
            "omni_connector_operations", "Puts and gets on each connector", labels=["connector", "direction"]
        )
        errors = CounterMetricFamily("omni_connector_errors", "Failed puts and gets", labels=["connector"])
        timeouts = CounterMetricFamily(
            "omni_connector_timeouts", "Values released because their lease ran out", labels=["connector"]
        )
        outstanding = GaugeMetricFamily(
            "omni_connector_outstanding", "Values put and not yet released", labels=["connector"]
        )
        for name, connector in self.omni.connectors.items():
            try:
                h = connector.health()
            except Exception:  # a scrape must not fail because one connector is closing
                continue
            moved.add_metric([name, "put"], h.bytes_put)
            moved.add_metric([name, "get"], h.bytes_got)
            moved.add_metric([name, "acked"], h.bytes_acked)
            ops.add_metric([name, "put"], h.puts)
            ops.add_metric([name, "get"], h.gets)
            errors.add_metric([name], h.errors)
            timeouts.add_metric([name], h.timeouts)
            outstanding.add_metric([name], h.outstanding)
        yield from (moved, ops, errors, timeouts, outstanding)


class OmniMetrics:
    """Our metrics, in the registry vLLM's ``/metrics`` serves."""

    def __init__(self, omni: AsyncOmni, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

        self.registry = registry
        self.collector = OmniCollector(omni)
        self.stage_latency = Histogram(
            "omni_stage_latency_seconds",
            "Time each request spent in each stage (queueing in the stage included)",
            ["stage", "name"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.request_latency = Histogram(
            "omni_request_latency_seconds",
            "End-to-end time of each image through every stage",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.images = Counter(
            "omni_images_generated", "Images returned to clients", ["endpoint"], registry=None
        )
        self.failures = Counter(
            "omni_requests_failed",
            "Image requests that failed, by HTTP status",
            ["endpoint", "status"],
            registry=None,
        )
        self._registered: list[Any] = []
        for metric in (self.collector, self.stage_latency, self.request_latency, self.images, self.failures):
            registry.register(metric)
            self._registered.append(metric)

    def observe(self, endpoint: str, results: list[OmniResult], stage_names: dict[int, str]) -> None:
        for result in results:
            if result.ok:
                self.images.labels(endpoint).inc()
                if "total" in result.timings:
                    self.request_latency.labels(endpoint).observe(result.timings["total"])
            for sid, name in stage_names.items():
                value = result.timings.get(f"stage_{sid}")
                if value is not None:
                    self.stage_latency.labels(str(sid), name).observe(value)

    def close(self) -> None:
        for metric in self._registered:
            with contextlib.suppress(KeyError):
                self.registry.unregister(metric)
        self._registered.clear()


# --- the serving state -------------------------------------------------------------------------


def replica_pid(client: Any) -> int | None:
    if hasattr(client, "remote_pid"):  # a headless worker's pid, on its own host
        return client.remote_pid
    manager = getattr(client, "manager", None)
    if manager is not None:
        return getattr(manager, "pid", None)
    engine = getattr(client, "engine", None)
    if engine is not None:
        pids = compat.engine_core_pids(engine)
        return pids[0] if pids else None
    return os.getpid() if getattr(client, "healthy", False) else None


def result_error(result: OmniResult) -> OmniAPIError:
    """A failed result -> the error its client gets (dead stage: 503; a request vLLM rejected: 400)."""
    exc = result.exception
    message = result.error or "the request failed"
    if isinstance(exc, StageDeadError | StageStartError) or "died" in message:
        return OmniAPIError(message, status=503)
    if isinstance(exc, RequestAbortedError):
        return OmniAPIError(
            f"the request was aborted ({message}); the server may be shutting down", status=503
        )
    client_error = compat.resolve("VLLMClientError")
    if isinstance(exc, ValueError | TypeError | client_error):
        return OmniAPIError(message, status=400)
    return OmniAPIError(message, status=500)


async def _disconnected(raw: Request) -> None:
    """Returns when the client goes away (the body is already read, so only a disconnect can come)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class OmniServer:
    omni: AsyncOmni
    settings: ServerSettings
    metrics: OmniMetrics | None = None
    stage_names: dict[int, str] = field(default_factory=dict)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def limits(self) -> ImageLimits:
        return self.settings.limits

    def check_model(self, model: str | None) -> str:
        names = self.settings.served_model_names
        if model is not None and model not in names:
            raise OmniAPIError(f"The model `{model}` does not exist.", status=404, param="model")
        return model or names[0]

    def check_size(self, width: int, height: int, image_to_image: bool, param: str = "size") -> None:
        check_dimensions(width, height, self.limits, param)
        budget, max_len = self.settings.token_budget, self.settings.ar_max_model_len
        if budget is not None and max_len:
            needed = int(budget(height, width, image_to_image))
            if needed >= int(max_len):
                raise OmniAPIError(
                    f"a {width}x{height} image needs {needed} AR tokens, more than the AR stage's "
                    f"max_model_len {max_len} allows; ask for a smaller size (or serve with a larger "
                    "--max-model-len)",
                    param=param,
                )

    def check_steps(self, steps: int | None) -> None:
        if steps is not None and steps > self.limits.max_inference_steps:
            raise OmniAPIError(
                f"num_inference_steps must be at most {self.limits.max_inference_steps}",
                param="num_inference_steps",
            )

    async def run(self, endpoint: str, requests: list[OmniRequest], raw: Request) -> list[OmniResult]:
        """Run every request through the pipeline; all succeed or the request fails as a whole."""
        work = asyncio.ensure_future(asyncio.gather(*(self.omni.generate(r) for r in requests)))
        watch = asyncio.ensure_future(_disconnected(raw))
        gone = True
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            gone = not work.done()
        finally:
            watch.cancel()
            if not work.done():  # the client went away (or this handler was cancelled): abort
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
        if gone:
            logger.info("client of %s went away; aborted %d request(s)", endpoint, len(requests))
            raise OmniAPIError("the client disconnected", status=499)
        results: list[OmniResult] = work.result()
        if self.metrics is not None:
            self.metrics.observe(endpoint, results, self.stage_names)
        failed = [r for r in results if not r.ok]
        if failed:
            errors = [result_error(r) for r in failed]
            worst = max(errors, key=lambda e: (e.status == 503, e.status))
            if self.metrics is not None:
                self.metrics.failures.labels(endpoint, str(worst.status)).inc()
            logger.warning("%s failed (%d): %s", endpoint, worst.status, worst.message)
            raise worst
        return results

    def health(self) -> tuple[bool, dict[str, Any]]:
        stages: dict[str, Any] = {}
        for sid, pool in self.omni.pools.items():
            state = pool.health()
            for replica, client in zip(state["replicas"], pool.clients, strict=True):
                replica["pid"] = replica_pid(client)
                worker = getattr(client, "worker", None)
                if hasattr(client, "awaits_worker"):
                    replica["worker"] = (
                        f"{worker.host} pid {worker.pid}" if worker and client.healthy else None
                    )
            stages[str(sid)] = state
        # A headless stage whose worker is away is the worker's problem, not the head's: the head stays
        # healthy (its requests for that stage wait for the worker or fail with 503) and says so.
        waiting = [p for p in self.omni.pools.values() if not p.healthy and all(
            getattr(c, "awaits_worker", False) for c in p.clients)]  # fmt: skip
        ok = bool(self.omni.pools) and all(p.healthy or p in waiting for p in self.omni.pools.values())
        status = "unavailable" if not ok else "waiting_for_workers" if waiting else "ok"
        return ok, {"status": status, "stages": stages}

    def start_stat_logging(self, interval: float) -> None:
        """vLLM's periodic throughput lines for the AR engines, as ``vllm serve`` prints them."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                for pool in self.omni.pools.values():
                    for client in pool.clients:
                        engine = getattr(client, "engine", None)
                        if engine is not None and client.healthy:
                            with contextlib.suppress(Exception):
                                await engine.do_log_stats()

        task = asyncio.create_task(loop(), name="omni stat logging")
        self._tasks.add(task)

    def watch_shutdown(self, app: FastAPI) -> None:
        """Once serve_http starts shutting down, a stage that dies is no longer restarted.

        Ctrl-C reaches the whole process group, and vLLM's EngineCore stops on it: its in-flight
        requests fail (503) rather than waiting for a new engine that shutdown would stop at once.
        """

        async def watch() -> None:
            while True:
                await asyncio.sleep(0.1)
                http = getattr(getattr(app, "state", None), "server", None)
                if http is not None and getattr(http, "should_exit", False):
                    break
            for pool in self.omni.pools.values():
                for client in pool.clients:
                    if hasattr(client, "restart_on_death"):
                        client.restart_on_death = False

        task = asyncio.create_task(watch(), name="omni shutdown watch")
        self._tasks.add(task)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.metrics is not None:
            self.metrics.close()


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
        import base64

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
    images: list[Any] | tuple[Any, ...] = (),
    sampling_params: dict[str, Any] | None = None,
) -> list[OmniRequest]:
    """The ``n`` requests of one API call (every image route): one per seed, the rest shared."""
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
        )
        for seed in _seeds(req.seed, req.n)
    ]


# --- routes ------------------------------------------------------------------------------------

router = APIRouter()


@router.post("/v1/images/generations")
async def create_images(raw: Request) -> Response:
    server = _server(raw)
    req = parse_request(ImageGenerationRequest, await _read_json(raw, _json_limit(server.limits)))
    server.check_model(req.model)
    response_format = _check_response_format(server, req.response_format)
    size = parse_size(req.size, server.limits)
    width, height = size or (server.limits.default_width, server.limits.default_height)
    server.check_size(width, height, image_to_image=False)
    server.check_steps(req.num_inference_steps)
    requests = _image_requests(req, req.prompt, width, height)
    results = await server.run("images/generations", requests, raw)
    return await _images_response(
        server, raw, results, response_format=response_format, output_format=req.output_format or "png",
        compression=req.output_compression, width=width, height=height,
    )  # fmt: skip


@router.post("/v1/images/edits")
async def edit_images(raw: Request) -> Response:
    server = _server(raw)
    limits = server.limits
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
    server.check_size(width, height, image_to_image=True)
    server.check_steps(req.num_inference_steps)
    requests = _image_requests(req, req.prompt, width, height, images)
    results = await server.run("images/edits", requests, raw)
    return await _images_response(
        server, raw, results, response_format=response_format, output_format=req.output_format or "png",
        compression=req.output_compression, width=width, height=height,
    )  # fmt: skip


@router.post("/v1/chat/completions")
async def chat_completions(raw: Request) -> Response:
    server = _server(raw)
    limits = server.limits
    req = parse_request(ChatCompletionRequest, await _read_json(raw, _json_limit(limits)))
    if "image" not in (req.modalities or []):
        raise OmniAPIError(
            f"this deployment ({server.omni.deployment.pipeline}) generates images and cannot answer in "
            'text: send "modalities": ["image"]',
            param="modalities",
        )
    if req.stream:
        raise OmniAPIError("stream is not supported for image output", param="stream")
    model = server.check_model(req.model)
    server.check_steps(req.num_inference_steps)
    prompt, images = await asyncio.to_thread(chat_prompt_and_images, req.messages, limits)
    size = parse_size(req.size, limits)
    if size is None and (req.height is not None or req.width is not None):
        size = (req.width or limits.default_width, req.height or limits.default_height)
    if size is None and images:
        size = fit_to_grid(images[0].shape[1], images[0].shape[0], limits)
    width, height = size or (limits.default_width, limits.default_height)
    server.check_size(width, height, image_to_image=bool(images), param="size" if req.size else "height")
    output_format = req.output_format or "png"
    requests = _image_requests(req, prompt, width, height, images, req.sampling_params())
    results = await server.run("chat/completions", requests, raw)
    encoded = await _encode_all(results, output_format, None)
    choices = [
        ChatChoice(
            index=i,
            message=ChatMessage(role="assistant", content=f"![image]({data_uri(blob, output_format)})"),
        )
        for i, blob in enumerate(encoded)
    ]
    return _json(
        ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model, choices=choices
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


async def _api_error_handler(raw: Request, exc: Exception) -> Response:
    assert isinstance(exc, OmniAPIError)
    return Response(
        error_body(exc.message, exc.status, exc.param), status_code=exc.status, media_type="application/json"
    )


# --- app ---------------------------------------------------------------------------------------


def build_api_app(args: argparse.Namespace, server: OmniServer) -> FastAPI:
    """vLLM's app (middleware, auth, CORS, exception handlers, /metrics) with our routes."""
    app = compat.build_app(args, supported_tasks=())
    dropped = [getattr(r, "path", type(r).__name__) for r in app.router.routes if not _keep_route(r)]
    app.router.routes[:] = [r for r in app.router.routes if _keep_route(r)]
    logger.debug("vLLM routes not served by the omni server: %s", ", ".join(map(str, dropped)))
    app.include_router(router)
    app.add_exception_handler(OmniAPIError, _api_error_handler)
    # vLLM's build_app returns an app whose middleware stack is already built (SageMaker's bootstrap
    # builds it), and a built stack holds a copy of the exception handlers: rebuild it on first use.
    app.middleware_stack = None
    app.state.engine_client = None  # vLLM's serve_http and lifespan: no vLLM text engine behind this app
    app.state.log_stats = False
    app.state.omni_server = server
    return app


def _keep_route(route: Any) -> bool:
    return getattr(route, "path", None) in KEEP_VLLM_PATHS


# --- running -----------------------------------------------------------------------------------


class ServeError(Exception):
    """A problem found before anything started (busy port, missing model): one ``error:`` line."""


def bind_socket(args: argparse.Namespace) -> tuple[str, Any]:
    """Bind the listening socket as ``vllm serve`` does, before any stage starts."""
    try:
        return compat.setup_server(args, reuse_port=False)
    except OSError as exc:
        where = args.uds or f"{args.host or '0.0.0.0'}:{args.port}"
        if exc.errno == errno.EADDRINUSE:
            raise ServeError(
                f"cannot listen on {where}: the address is already in use; pick another --port"
            ) from None
        raise ServeError(f"cannot listen on {where}: {exc.strerror or exc}") from None


def _log_ready(deployment: ResolvedDeployment, server: OmniServer) -> None:
    for stage in deployment.stages:
        pool = server.omni.pools.get(stage.stage_id)
        if pool is None or stage.headless:  # its worker says where it runs when it registers
            continue
        devices = ", ".join(
            f"replica {r.replica_id}: {deployment.platform}{':' + r.devices if r.devices else ''} "
            f"(pid {replica_pid(c)})"
            for r, c in zip(stage.replicas, pool.clients, strict=False)
        )
        logger.info("stage %d (%s, %s) ready: %s", stage.stage_id, stage.name, stage.execution_type, devices)


def uvicorn_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import envs

    kwargs: dict[str, Any] = dict(
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=getattr(envs, "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", 5),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        ssl_ciphers=getattr(args, "ssl_ciphers", None),
        h11_max_incomplete_event_size=getattr(args, "h11_max_incomplete_event_size", None),
        h11_max_header_count=getattr(args, "h11_max_header_count", None),
        timeout_graceful_shutdown=float(getattr(args, "shutdown_timeout", 0) or DEFAULT_DRAIN_S),
    )
    log_config = compat.get_uvicorn_log_config(args)
    if log_config is not None:
        kwargs["log_config"] = log_config
    return kwargs


async def serve(
    args: argparse.Namespace, deployment: ResolvedDeployment, sock: Any, listen_address: str
) -> None:
    """Start every stage, serve until SIGINT/SIGTERM, then stop every stage."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    interrupted: list[int] = []

    def interrupt(sig: int) -> None:  # until serve_http installs its own handlers
        if not interrupted:
            interrupted.append(sig)
            logger.info("%s while starting the stages; stopping", signal.Signals(sig).name)
            main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupt, sig)
    omni = AsyncOmni(deployment)
    server = OmniServer(omni, settings_from_args(args, deployment))
    try:
        try:
            await omni.start()
        except asyncio.CancelledError:
            if not interrupted:
                raise
            return
        server.metrics = OmniMetrics(omni, compat.get_prometheus_registry())
        server.stage_names = {s.stage_id: s.name for s in deployment.stages}
        _log_ready(deployment, server)
        if not getattr(args, "disable_log_stats", False):
            from vllm import envs

            server.start_stat_logging(float(getattr(envs, "VLLM_LOG_STATS_INTERVAL", 10.0)))
        app = build_api_app(args, server)
        server.watch_shutdown(app)
        logger.info("omni server (%s) listening on %s", deployment.pipeline, listen_address)
        shutdown = await compat.serve_http(
            app,
            sock=sock,
            enable_ssl_refresh=getattr(args, "enable_ssl_refresh", False),
            **uvicorn_kwargs(args),
        )
        await shutdown
        logger.info("HTTP server stopped; stopping the stages")
    finally:
        server.close()
        await omni.shutdown()
        sock.close()
        logger.info("every stage stopped")


def run_server(args: argparse.Namespace, deployment: ResolvedDeployment) -> None:
    """Bind, start the stages and serve; returns after a clean shutdown (SIGINT/SIGTERM)."""
    if not os.path.isdir(deployment.model):
        raise ServeError(f"model directory {deployment.model!r} does not exist")
    media_dir = getattr(args, "image_media_dir", None)
    if media_dir:
        try:
            os.makedirs(media_dir, exist_ok=True)
        except OSError as exc:
            raise ServeError(f"--image-media-dir {media_dir}: {exc.strerror or exc}") from None
    with contextlib.suppress(Exception):
        compat.configure_logging_from_args(args)
    listen_address, sock = bind_socket(args)
    try:
        asyncio.run(serve(args, deployment, sock, listen_address))
    finally:
        sock.close()
