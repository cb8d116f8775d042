"""The omni API server: vLLM's own FastAPI app with the image routes of an omni pipeline on top.

The app comes from vLLM's ``build_app`` (through ``compat``) so ``--api-key``, CORS, ``--middleware``,
request-id headers, the Prometheus HTTP instrumentation and uvicorn's logging behave as in ``vllm
serve``. vLLM's own routes that need its text-serving state (which an omni deployment does not set up)
or that ours replace are removed; ``/metrics``, ``/version`` and the docs stay. It is served by vLLM's
``serve_http`` on the socket ``setup_server`` bound before any stage started (so a busy port fails
fast). SIGINT/SIGTERM: stop accepting, let in-flight requests finish (up to the drain timeout), stop
every stage, exit 0.

This module is the app and its lifecycle; the routes are in ``routes``, the serving state in
``omni_server``, the metrics in ``metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import socket
import sqlite3
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from vllm_omni_plugin import compat
from vllm_omni_plugin.config import ResolvedDeployment
from vllm_omni_plugin.diffusion.lora import LoraError
from vllm_omni_plugin.entrypoints.errors import OmniAPIError
from vllm_omni_plugin.entrypoints.metrics import OmniMetrics
from vllm_omni_plugin.entrypoints.omni_server import OmniServer, settings_from_args
from vllm_omni_plugin.entrypoints.routes import api_error_handler, framework_error_handler, router
from vllm_omni_plugin.entrypoints.video_calls import VideoService, default_video_dir
from vllm_omni_plugin.entrypoints.video_jobs import VideoJobStore
from vllm_omni_plugin.entrypoints.video_protocol import VideoLimits
from vllm_omni_plugin.log import best_effort, get_logger
from vllm_omni_plugin.stage.async_omni import AsyncOmni
from vllm_omni_plugin.stage.input_work import input_work
from vllm_omni_plugin.stage.placement.base import StagePlacement

logger = get_logger(__name__)

# vLLM routes that work without an engine client and that we do not replace.
KEEP_VLLM_PATHS = frozenset(
    {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/version", "/metrics"}
)
DEFAULT_DRAIN_S = 30.0
"""How long SIGINT/SIGTERM waits for in-flight requests when ``--shutdown-timeout`` is 0 (vLLM's
default): an image request cannot be answered half-way, so we drain rather than abort."""


def build_api_app(args: argparse.Namespace, server: OmniServer) -> FastAPI:
    """vLLM's app (middleware, auth, CORS, exception handlers, /metrics) with our routes."""
    app = compat.build_app(args, supported_tasks=())
    dropped = [getattr(r, "path", type(r).__name__) for r in app.router.routes if not _keep_route(r)]
    app.router.routes[:] = [r for r in app.router.routes if _keep_route(r)]
    logger.debug("vLLM routes not served by the omni server: %s", ", ".join(map(str, dropped)))
    app.include_router(router)
    app.add_exception_handler(OmniAPIError, api_error_handler)
    _framework_errors_as_error_json(app)
    # vLLM's build_app returns an app whose middleware stack is already built (SageMaker's bootstrap
    # builds it), and a built stack holds a copy of the exception handlers: rebuild it on first use.
    app.middleware_stack = None
    app.state.engine_client = None  # vLLM's serve_http and lifespan: no vLLM text engine behind this app
    app.state.log_stats = False
    app.state.omni_server = server
    return app


def _keep_route(route: Any) -> bool:
    return getattr(route, "path", None) in KEEP_VLLM_PATHS


def _framework_errors_as_error_json(app: FastAPI) -> None:
    """Starlette's routing errors (404, 405) and FastAPI's request validation errors as error JSON on our
    paths, where vLLM's app left FastAPI's ``{"detail": ...}`` answer (vLLM 0.32 handles FastAPI's
    ``HTTPException`` subclass and validation errors itself, not the router's own errors); elsewhere
    the handler it replaces answers, so vLLM's routes answer as in ``vllm serve``."""
    defaults = {
        HTTPException: http_exception_handler,
        RequestValidationError: request_validation_exception_handler,
    }
    for exc_type, default in defaults.items():
        current = app.exception_handlers.get(exc_type, default)
        if current is default:
            app.add_exception_handler(exc_type, framework_error_handler(current))


# --- running -----------------------------------------------------------------------------------


class ServeError(Exception):
    """A problem found before anything started (busy port, missing model): one ``error:`` line."""


def bind_socket(args: argparse.Namespace) -> tuple[str, Any]:
    """Bind the listening socket as ``vllm serve`` does, before any stage starts."""
    try:
        listen_address, sock = compat.setup_server(args, reuse_port=False)
    except OSError as exc:
        where = args.uds or f"{args.host or '0.0.0.0'}:{args.port}"
        if exc.errno == errno.EADDRINUSE:
            raise ServeError(
                f"cannot listen on {where}: the address is already in use; pick another --port"
            ) from None
        raise ServeError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        # Connections inherit this: a response's headers and body go out at once. Without it a client
        # that keeps its connection open (httpx, the openai client) waits ~40 ms per response for its
        # delayed ACK of the headers, which is most of the time of a small image.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return listen_address, sock


def _log_ready(deployment: ResolvedDeployment, server: OmniServer) -> None:
    for stage in deployment.stages:
        pool = server.omni.pools.get(stage.stage_id)
        if pool is None or stage.headless:  # its worker says where it runs when it registers
            continue
        devices = ", ".join(
            f"replica {r.replica_id}: {deployment.platform}{':' + r.devices if r.devices else ''} "
            f"(pid {c.pid})"
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
    args: argparse.Namespace,
    deployment: ResolvedDeployment,
    sock: Any,
    listen_address: str,
    *,
    placement: StagePlacement | None = None,
) -> None:
    """Start every stage (its replicas where ``placement`` puts them, by default where the deployment's
    backend does), serve until SIGINT/SIGTERM, then stop every stage."""
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
    omni = AsyncOmni(deployment, placement=placement)
    server = OmniServer(omni, settings_from_args(args, deployment))
    server.videos = open_videos(args, server)
    try:
        await input_work(server.add_startup_adapters)
    except LoraError as exc:
        raise ServeError(f"--lora-modules: {exc}") from None
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
        if server.videos is not None:
            await server.videos.close()
        server.close()
        await omni.shutdown()
        sock.close()
        logger.info("every stage stopped")


def open_videos(args: argparse.Namespace, server: OmniServer) -> VideoService | None:
    """The Videos API where the served model makes videos: its job store opened (a directory this server
    cannot use, or one another server holds, stops the start in one line)."""
    if not server.omni.inputs.frame_step:
        return None
    directory = Path(args.video_dir) if args.video_dir else default_video_dir()
    limits = VideoLimits(
        max_frames=args.video_max_frames,
        max_side=args.video_max_size,
        max_seconds=float(args.video_max_seconds),
        max_jobs=args.video_max_jobs,
        max_bytes=args.video_max_bytes,
        max_active=args.video_max_active,
    )
    try:
        store = VideoJobStore(directory, limits)
    except (OSError, RuntimeError, sqlite3.Error) as exc:
        raise ServeError(f"--video-dir {directory}: {exc}") from None
    logger.info("videos kept in %s (%d)", directory, store.count())
    return VideoService(server, store, limits, default_fps=args.video_fps)


def run_server(args: argparse.Namespace, deployment: ResolvedDeployment) -> None:
    """Bind, start the stages and serve; returns after a clean shutdown (SIGINT/SIGTERM)."""
    if not os.path.isdir(deployment.model):
        raise ServeError(f"model directory {deployment.model!r} does not exist")
    media_dir = args.image_media_dir
    if media_dir:
        try:
            os.makedirs(media_dir, exist_ok=True)
        except OSError as exc:
            raise ServeError(f"--image-media-dir {media_dir}: {exc.strerror or exc}") from None
    with best_effort("configuring vLLM's logging from the arguments", logger):
        compat.configure_logging_from_args(args)
    listen_address, sock = bind_socket(args)
    try:
        asyncio.run(serve(args, deployment, sock, listen_address))
    finally:
        sock.close()
