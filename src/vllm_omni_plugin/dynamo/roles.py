"""What each role serves on Dynamo's runtime. The pipeline and router roles: the whole deployment in this
process (``AsyncOmni``, as under ``vllm serve --omni``) behind a Dynamo endpoint that the frontend finds by
the model registered on it. The stage role: one stage's replicas (``stage_worker.py``) behind the stage's
endpoint, for routers.

Each request the frontend sends goes through ``request_fields`` (Dynamo's dict -> our request types) and then
exactly what our HTTP routes do (``entrypoints/api_calls.py``: the same checks in the same order, the
same requests, the same response body), run by the same ``OmniServer``. When Dynamo stops a
request (its client went away) the request is aborted in every stage. A failed request is logged in one
line with its id and raised as the Dynamo exception its status maps to.

The router role is the same process with every stage placed on Dynamo stage workers (``placement.py``);
it registers the model once each stage has a worker.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vllm_omni_plugin.config import ResolvedDeployment
from vllm_omni_plugin.dynamo import request_fields
from vllm_omni_plugin.dynamo.placement import DynamoPlacement
from vllm_omni_plugin.dynamo.runtime import (
    DynamoSettings,
    Replies,
    error_for,
    expose_metrics,
    make_runtime,
    serve,
    stop_on_signals,
    until_stopped,
)
from vllm_omni_plugin.dynamo.stage_worker import DynamoStageWorker
from vllm_omni_plugin.entrypoints.api_calls import (
    chat_body,
    chat_call,
    edit_call,
    generation_call,
    images_body,
)
from vllm_omni_plugin.entrypoints.chat_protocol import ChatCompletionRequest
from vllm_omni_plugin.entrypoints.errors import OmniAPIError, parse_request
from vllm_omni_plugin.entrypoints.image_codec import decode_data_uri
from vllm_omni_plugin.entrypoints.image_protocol import ImageEditRequest, ImageGenerationRequest
from vllm_omni_plugin.entrypoints.metrics import ABORT_PLACES, OmniMetrics
from vllm_omni_plugin.entrypoints.omni_server import OmniServer, http_status, settings_from_args
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.async_omni import AsyncOmni
from vllm_omni_plugin.stage.factory import placement_for
from vllm_omni_plugin.stage.replica_pool import StageReplicaPool

logger = get_logger(__name__)

NO_MEDIA = "response_format=url is not served under Dynamo (the worker has no media route)"
WAITING_LOG_S = 30.0


class ModelEndpoint:
    """The handler of the served model's Dynamo endpoint (its second parameter must be named
    ``context``: Dynamo passes it by that name)."""

    def __init__(self, server: OmniServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop

    def generate(self, request: Any, context: Any) -> Replies:
        return Replies(self.loop, self._replies(request, context))

    async def _replies(self, request: Any, context: Any) -> list[dict[str, Any]]:
        """The replies, or the Dynamo exception of the failure (logged in one line with the request id)."""
        request_id = context.id()
        try:
            return await self.answer(request, context)
        except OmniAPIError as exc:
            if exc.status == 499:  # its client went away (logged by the server): nobody reads an answer
                return []
            endpoint = _endpoint_label(request)
            logger.warning("request %s (%s) failed (%d): %s", request_id, endpoint, exc.status, exc.message)
            raise error_for(exc.status, exc.message) from None
        except Exception as exc:  # a bug: logged with its trace, the client gets a bare 500
            status = http_status(exc)
            logger.error(
                "request %s (%s) failed (%d)", request_id, _endpoint_label(request), status, exc_info=exc
            )
            raise error_for(status, f"{type(exc).__name__}: {exc}") from None

    async def answer(self, request: Any, context: Any) -> list[dict[str, Any]]:
        """What the frontend gets for ``request``: the replies, or the ``OmniAPIError`` our HTTP server
        would answer the same request with. ``context``: Dynamo's (its ``async_killed_or_stopped``)."""
        server = self.server
        endpoint = request_fields.endpoint_of(request)
        if endpoint == request_fields.CHAT:
            req = parse_request(ChatCompletionRequest, request_fields.chat_fields(request))
            call = await chat_call(server, req)
            results = await server.run(call.endpoint, call.requests, until_stopped(context))
            return request_fields.chat_chunks(await chat_body(call, results))
        if endpoint == request_fields.EDITS:
            limits = server.limits
            fields, sources = request_fields.edit_fields(request, limits.max_input_images)
            req = parse_request(ImageEditRequest, fields)

            async def read_images() -> list[Any]:
                return [await asyncio.to_thread(decode_data_uri, url, limits, at) for at, url in sources]

            call = await edit_call(server, req, read_images, image_param="input_reference")
        else:
            req = parse_request(ImageGenerationRequest, request_fields.image_fields(request))
            call = await generation_call(server, req)
        results = await server.run(call.endpoint, call.requests, until_stopped(context))
        return [request_fields.images_reply(await images_body(call, results))]


def _endpoint_label(request: Any) -> str:
    try:
        return request_fields.endpoint_of(request)
    except OmniAPIError:
        return "request"


async def serve_model(
    args: argparse.Namespace,
    deployment: ResolvedDeployment,
    settings: DynamoSettings,
    *,
    router: bool = False,
) -> int:
    """Run the pipeline role (``router``: the router role) until SIGINT/SIGTERM; the exit code."""
    runtime = make_runtime(settings)
    placement = (
        DynamoPlacement(deployment, runtime, settings.stage_path) if router else placement_for(deployment)
    )
    omni = AsyncOmni(deployment, placement=placement)
    server_settings = dataclasses.replace(
        settings_from_args(args, deployment), media_dir=None, no_media=NO_MEDIA
    )
    server = OmniServer(omni, server_settings)
    stopping = stop_on_signals(runtime, lambda _: _stop_restarting(omni.pools.values()))
    try:
        if not await _until(omni.start(), stopping):
            return 0
        server.stage_names = {s.stage_id: s.name for s in deployment.stages}
        endpoint = runtime.endpoint(settings.model_path)
        server.metrics, collect = _metrics(omni)
        expose_metrics(endpoint, collect)
        if router and not await _until(_stage_workers(omni), stopping):
            return 0
        if not getattr(args, "disable_log_stats", False):
            server.start_stat_logging(10.0)
        names = server_settings.served_model_names
        await _register(endpoint, deployment, names)
        logger.info(
            "serving %s (%s) as Dynamo model %r on dyn://%s", deployment.model, deployment.pipeline, names[0],
            settings.model_path,
        )  # fmt: skip
        runtime.set_health_status(True)
        await serve(endpoint, ModelEndpoint(server, asyncio.get_running_loop()).generate, stopping)
        return 0
    finally:
        server.close()
        await omni.shutdown()
        runtime.shutdown()
        logger.info("every stage stopped")


async def serve_stage(deployment: ResolvedDeployment, stage_id: int, settings: DynamoSettings) -> int:
    """Run the stage role (stage ``stage_id``'s replicas on this host, served to routers) until
    SIGINT/SIGTERM; the exit code."""
    runtime = make_runtime(settings)
    worker = DynamoStageWorker(deployment, stage_id)
    stopping = stop_on_signals(runtime, lambda _: worker.stop_restarting())
    try:
        if not await _until(worker.start(), stopping):
            return 0
        path = settings.stage_path(stage_id)
        endpoint = runtime.endpoint(path)
        expose_metrics(endpoint, _stage_metrics(worker))
        logger.info("serving stage %d on dyn://%s", stage_id, path)
        runtime.set_health_status(True)
        await serve(endpoint, worker.generate, stopping)
        return 0
    finally:
        await worker.shutdown()
        runtime.shutdown()
        logger.info("stage %d stopped", stage_id)


async def _until(work: Any, stopping: asyncio.Event) -> bool:
    """Await ``work`` unless a signal comes first (then it is cancelled): whether it finished."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False


async def _stage_workers(omni: AsyncOmni) -> None:
    """Until every stage has a worker (the router serves nothing before)."""
    logged = time.monotonic()
    while waiting := [p for p in omni.pools.values() if not p.healthy]:
        if time.monotonic() - logged > WAITING_LOG_S:
            names = ", ".join(f"stage {p.stage_id} ({p.name})" for p in waiting)
            logger.info("still waiting for Dynamo stage workers of %s", names)
            logged = time.monotonic()
        await asyncio.sleep(0.1)


def _stop_restarting(pools: Iterable[StageReplicaPool]) -> None:
    for pool in pools:  # a replica that dies from now on stays down
        pool.stop_restarting()


def _metrics(omni: AsyncOmni) -> tuple[OmniMetrics, Any]:
    """Our metrics in a registry of their own, rendered as Prometheus text on demand."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    return OmniMetrics(omni, registry), lambda: generate_latest(registry).decode()


def _stage_metrics(worker: DynamoStageWorker) -> Callable[[], str]:
    """The stage worker's own counts (its replicas' health, requests, drops, denoising steps) as
    Prometheus text; the router's metrics sum every worker's."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    name = next(s.name for s in worker.deployment.stages if s.stage_id == worker.stage_id)
    labels = [str(worker.stage_id), name]
    keys = ["stage", "name"]

    class Collector:
        def collect(self) -> Iterator[Any]:
            pool = worker.pool
            stats = worker.stats()
            healthy = GaugeMetricFamily(
                "omni_stage_healthy_replicas", "Replicas of the stage ready to serve", labels=keys
            )
            healthy.add_metric(labels, sum(1 for c in pool.clients if c.healthy) if pool else 0)
            calls = CounterMetricFamily(
                "omni_stage_worker_requests", "Stage requests routers sent this worker", labels=keys
            )
            calls.add_metric(labels, stats.calls)
            deaths = CounterMetricFamily(
                "omni_stage_replica_deaths", "Stage replica processes that died", labels=keys
            )
            deaths.add_metric(labels, stats.deaths)
            aborted = CounterMetricFamily(
                "omni_stage_aborted_requests",
                "Aborted requests the stage dropped: queue, batch or engine",
                labels=[*keys, "where"],
            )
            for where in ABORT_PLACES:
                aborted.add_metric([*labels, where], stats.dropped.get(where, 0))
            steps = CounterMetricFamily(
                "omni_diffusion_denoise_steps", "Denoising steps, counted per request", labels=keys
            )
            steps.add_metric(labels, stats.counters.denoise_steps)
            yield from (healthy, calls, deaths, aborted, steps)

    registry = CollectorRegistry()
    registry.register(Collector())
    return lambda: generate_latest(registry).decode()


async def _register(endpoint: Any, deployment: ResolvedDeployment, names: list[str]) -> None:
    """The model, as the frontend lists and routes it: images and chat, text in (the frontend passes the
    requests through), no model files for the frontend to read."""
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model

    await register_model(
        ModelInput.Text,
        ModelType.Images | ModelType.Chat,
        endpoint,
        deployment.model,
        names[0],
        worker_type=WorkerType.Aggregated,
        model_aliases=names[1:] or None,
        skip_model_assets=True,
    )
