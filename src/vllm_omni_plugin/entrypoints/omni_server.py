"""``OmniServer``: the serving state the HTTP routes share: what this deployment accepts (settings drawn
from the command line and the pipeline's facts), running requests through the runtime, health, and
how a failed request maps to an HTTP status (by the failure's type)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request

from vllm_omni_plugin import compat
from vllm_omni_plugin.config import ResolvedDeployment, get_pipeline
from vllm_omni_plugin.config.pipeline import registered_pipelines
from vllm_omni_plugin.config.settings import SettingError, read_settings
from vllm_omni_plugin.diffusion.lora import LoraSpec
from vllm_omni_plugin.entrypoints.errors import OmniAPIError
from vllm_omni_plugin.entrypoints.image_protocol import ImageLimits, check_prompt_length
from vllm_omni_plugin.entrypoints.lora_adapters import ServedAdapters
from vllm_omni_plugin.entrypoints.metrics import OmniMetrics
from vllm_omni_plugin.log import best_effort, get_logger
from vllm_omni_plugin.stage.async_omni import AsyncOmni
from vllm_omni_plugin.stage.errors import RequestAbortedError, StageError
from vllm_omni_plugin.stage.input_processor import InputError, OmniCoreRequest, OmniRequest, RequestBounds
from vllm_omni_plugin.stage.orchestrator import OmniResult
from vllm_omni_plugin.stage.request_events import RequestEvent

logger = get_logger(__name__)


@dataclass
class ServerSettings:
    served_model_names: list[str]
    limits: ImageLimits
    media_dir: str | None = None
    pipeline: str = ""
    settings_type: Any = None
    """The pipeline's request settings type (``Pipeline.settings``): the fields a request may carry
    beyond the generic ones; None: none."""
    other_settings: frozenset[str] = frozenset()
    """Settings other registered pipelines take and this one does not (refused as such, not as unknown)."""
    answers_in_text: bool = False
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    """Adapters named at start-up (``--lora-modules``): (name, path)."""
    no_media: str = "response_format=url needs a media directory on the server (--image-media-dir)"
    """Why ``response_format=url`` is refused where no media directory is set."""


def settings_from_args(args: argparse.Namespace, deployment: ResolvedDeployment) -> ServerSettings:
    pipeline = get_pipeline(deployment.pipeline)
    names = list(args.served_model_name or []) or [args.model]
    limits = ImageLimits(
        max_side=args.image_max_size,
        max_upload_bytes=args.image_max_upload_bytes,
        max_inference_steps=args.image_max_inference_steps,
        max_prompt_chars=args.image_max_prompt_chars,
    )
    return ServerSettings(
        served_model_names=names,
        limits=limits,
        media_dir=args.image_media_dir,
        pipeline=pipeline.name,
        settings_type=pipeline.settings_type,
        other_settings=frozenset(name for p in registered_pipelines().values() for name in p.setting_names)
        - set(pipeline.setting_names),
        answers_in_text=pipeline.answers_in_text,
        lora_modules=[(m.name, m.path) for m in args.lora_modules or []],
    )


def http_status(exc: BaseException | None) -> int:
    """The status a failure is answered with: stage errors carry theirs; what vLLM or a stage-input
    processor rejected as a bad value is the client's (400); anything else is ours (500)."""
    if isinstance(exc, StageError):
        return exc.http_status
    if isinstance(exc, ValueError | TypeError | compat.resolve("VLLMClientError")):
        return 400
    return 500


def result_error(result: OmniResult) -> OmniAPIError:
    """A failed result -> the error its client gets."""
    message = result.error or "the request failed"
    if isinstance(result.exception, RequestAbortedError):
        message = f"the request was aborted ({message}); the server may be shutting down"
    return OmniAPIError(message, status=http_status(result.exception))


async def disconnected(raw: Request) -> None:
    """Returns when an HTTP client goes away (the body is already read, so only a disconnect can come)."""
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
    videos: Any = None
    """The Videos API's service (``video_calls.VideoService``) where the model makes videos."""
    adapters: ServedAdapters = field(init=False)
    """The LoRA adapters requests may name."""

    def __post_init__(self) -> None:
        inputs = self.omni.inputs
        self.adapters = ServedAdapters(self.omni.deployment.model, inputs.lora_refusal)
        facts = inputs.facts
        if facts is not None and facts.max_images is not None:  # what the model's pipeline takes per request
            most = min(self.settings.limits.max_input_images, facts.max_images)
            self.settings = dataclasses.replace(
                self.settings, limits=dataclasses.replace(self.settings.limits, max_input_images=most)
            )

    def add_startup_adapters(self) -> None:
        """The ``--lora-modules`` adapters, each checked (a :class:`LoraError` naming the bad one)."""
        for name, path in self.settings.lora_modules:
            self.adapters.check(name, path)
            self.adapters.add(name, path)

    @property
    def limits(self) -> ImageLimits:
        """What this server accepts on the wire (the operator's bounds)."""
        return self.settings.limits

    def check_model(self, model: str | None) -> str:
        names = self.settings.served_model_names
        if model is not None and model not in names and model not in self.adapters.names:
            raise OmniAPIError(f"The model `{model}` does not exist.", status=404, param="model")
        return model or names[0]

    def check_lora(self, lora: Any, model: str | None) -> LoraSpec | None:
        """The adapter a request names: its ``lora`` field (a name, or ``{"name", "scale"}``), or its
        ``model`` when that is an adapter's name (as vLLM serves LLM adapters)."""
        by_model = model if model is not None and model in self.adapters.names else None
        if lora is None:
            return self.adapters.spec(by_model, 1.0, "model") if by_model is not None else None
        name, scale = (lora, 1.0) if isinstance(lora, str) else (lora.name, lora.scale)
        if by_model is not None and by_model != name:
            raise OmniAPIError(
                f"model names the adapter {by_model!r} and lora names {name!r}: name one", param="lora"
            )
        return self.adapters.spec(name, scale)

    def check_prompts(self, prompt: str | None, negative_prompt: str | None, param: str = "prompt") -> None:
        """The prompts' lengths in characters, before anything tokenizes them (the model's own token limits
        are checked off the event loop, before any stage runs)."""
        check_prompt_length(prompt, self.limits, param)
        check_prompt_length(negative_prompt, self.limits, "negative_prompt")

    async def prepare(
        self, requests: list[OmniRequest], params: Mapping[str, str], bounds: RequestBounds | None = None
    ) -> list[OmniCoreRequest]:
        """The call's parsed requests, complete and checked by the runtime's input processor (within
        ``bounds``, by default the Images API's); a refusal names the field as this call's transport does
        (``params``: the processor's field -> the param)."""
        bounds = bounds or RequestBounds(max_side=self.limits.max_side)
        try:
            return [await self.omni.process(request, bounds) for request in requests]
        except InputError as exc:
            param = params.get(exc.field, exc.field) if exc.field is not None else None
            raise OmniAPIError(exc.message, param=param) from None

    def check_settings(self, req: Any) -> dict[str, Any]:
        """The request's fields beyond the generic ones, read by the pipeline's settings type (e.g.
        BAGEL's ``cfg_text_scale``): the settings it gave. Another pipeline's setting, an unknown field or
        a bad value is the client's mistake."""
        fields = req.family_fields
        settings_type = self.settings.settings_type
        known = set(settings_type.__struct_fields__) if settings_type is not None else set()
        for name in sorted(set(fields) - known):
            if name in self.settings.other_settings:
                if fields[name] is None:
                    continue
                raise OmniAPIError(
                    f"{name} is not a setting of this deployment's pipeline ({self.settings.pipeline})",
                    param=name,
                )
            raise OmniAPIError(f"unknown field {name!r}", param=name)
        if settings_type is None:
            return {}
        try:
            return read_settings(settings_type, fields).given()
        except SettingError as exc:
            raise OmniAPIError(exc.message, param=exc.param) from None

    def check_image_input(self, images: int, endpoint: str, param: str) -> None:
        """Source images where the model takes them, and only there."""
        facts, label = self.omni.inputs.facts, self.omni.inputs.model_label
        takes_images = facts.takes_images if facts is not None else True
        needs_images = facts.needs_images if facts is not None else False
        if images and not takes_images:
            raise OmniAPIError(
                f"{endpoint}: this model ({label}) generates from text only and takes no input image; "
                "use /v1/images/generations, or chat without an image",
                param=param,
            )
        if not images and needs_images:
            raise OmniAPIError(
                f"{endpoint}: this model ({label}) edits images and needs a source image; send it to "
                "/v1/images/edits (multipart `image`) or as a chat message's image_url",
                param=param,
            )

    def check_mask_input(self, endpoint: str) -> None:
        """A mask only where the model repaints masked areas (a diffusers model's inpainting pipeline;
        the pipelines without model facts, GLM-Image and BAGEL, repaint none)."""
        facts, label = self.omni.inputs.facts, self.omni.inputs.model_label
        if facts is None or not facts.takes_mask:
            can = "edits without a mask" if facts is None or facts.takes_images else "text-to-image only"
            raise OmniAPIError(
                f"{endpoint}: this model ({label}) cannot repaint a masked area (it runs {can}); send the "
                "request without a mask",
                param="mask",
            )

    def check_response_format(self, response_format: str | None) -> str:
        if response_format == "url" and not self.settings.media_dir:
            raise OmniAPIError(
                f"{self.settings.no_media}; use response_format=b64_json", param="response_format"
            )
        return response_format or "b64_json"

    def check_steps(self, steps: int | None) -> None:
        if steps is not None and steps > self.limits.max_inference_steps:
            raise OmniAPIError(
                f"num_inference_steps must be at most {self.limits.max_inference_steps}",
                param="num_inference_steps",
            )

    async def run(
        self, endpoint: str, requests: list[OmniCoreRequest], client_gone: Awaitable[Any]
    ) -> list[OmniResult]:
        """Run every request through the pipeline; all succeed or the request fails as a whole.
        ``client_gone`` completes when the client goes away (an HTTP disconnect, Dynamo stopping the
        request): the requests are then aborted in every stage."""
        work = asyncio.ensure_future(asyncio.gather(*(self.omni.generate(r) for r in requests)))
        watch = asyncio.ensure_future(client_gone)
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
            self._gone(endpoint, len(requests))
            raise OmniAPIError("the client disconnected", status=499)
        return self.finish(endpoint, work.result())

    async def stream(
        self, endpoint: str, request: OmniCoreRequest, gone: Awaitable[Any] | None = None
    ) -> AsyncIterator[RequestEvent | OmniResult]:
        """Run one request, yielding its stages' events as they come (``request_events``), then its
        result; a failure raises as in :meth:`run`. When ``gone`` completes (the client went away), or
        the iterator is closed early, the request is aborted in every stage."""
        events: asyncio.Queue[RequestEvent] = asyncio.Queue()
        request = dataclasses.replace(request, on_event=events.put_nowait)
        work = asyncio.ensure_future(self.omni.generate(request))
        watch = asyncio.ensure_future(gone) if gone is not None else None
        try:
            while not work.done():
                event = asyncio.ensure_future(events.get())
                waits = {event, work} | ({watch} if watch is not None else set())
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if event.done():
                    yield event.result()
                else:
                    event.cancel()
                if watch is not None and watch.done():
                    raise OmniAPIError("the client disconnected", status=499)
            while not events.empty():
                yield events.get_nowait()
        finally:
            if watch is not None:
                watch.cancel()
            if not work.done():  # the client went away (or the server stops): abort it everywhere
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
                self._gone(endpoint, 1)
        (result,) = self.finish(endpoint, [work.result()])
        yield result

    def _gone(self, endpoint: str, requests: int) -> None:
        if self.metrics is not None:
            self.metrics.disconnects.labels(endpoint).inc()
        logger.info("client of %s went away; aborted %d request(s)", endpoint, requests)

    def finish(self, endpoint: str, results: list[OmniResult]) -> list[OmniResult]:
        """The results of one API call, counted; raises the worst failure's error if any failed."""
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
        pools = self.omni.pools
        stages = {str(sid): pool.health() for sid, pool in pools.items()}
        # A headless stage whose worker is away is the worker's problem, not the head's: the head stays
        # healthy (its requests for that stage wait for the worker or fail with 503) and says so.
        waiting = [p for p in pools.values() if p.awaits_worker]
        ok = bool(pools) and all(p.healthy or p.awaits_worker for p in pools.values())
        status = "unavailable" if not ok else "waiting_for_workers" if waiting else "ok"
        return ok, {"status": status, "stages": stages, "placement": self.omni.placement.health()}

    def start_stat_logging(self, interval: float) -> None:
        """Each replica's periodic stats (vLLM's throughput lines for the AR engines, as ``vllm serve``)."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                for pool in self.omni.pools.values():
                    for client in pool.clients:
                        with best_effort("logging a stage replica's stats", logger):
                            await client.log_stats()

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
                http = getattr(app.state, "server", None)  # set by vLLM's serve_http
                if http is not None and http.should_exit:
                    break
            for pool in self.omni.pools.values():
                pool.stop_restarting()

        task = asyncio.create_task(watch(), name="omni shutdown watch")
        self._tasks.add(task)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.metrics is not None:
            self.metrics.close()
