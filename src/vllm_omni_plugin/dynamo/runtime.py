"""Dynamo's runtime for our roles: whether it is installed, where a role's endpoints are, the
``DistributedRuntime`` the flags ask for, and the few calls every role makes into it. The one module of
``vllm_omni_plugin.dynamo`` that imports Dynamo at its top: the roles import it only once asked for."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from vllm_omni_plugin.dynamo.request_fields import dynamo_error
from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

DYNAMO_EXTRA = "pip install 'vllm-omni-plugin[dynamo]'"
DYNAMO_DISTRIBUTION = "ai-dynamo-runtime"


class DynamoSetupError(Exception):
    """Dynamo is missing, or its runtime cannot start with these settings: one line for the user."""


def require_dynamo() -> None:
    """Dynamo's runtime is importable here, or a one-line ``DynamoSetupError`` naming the extra."""
    try:
        from dynamo.llm import register_model  # noqa: F401
        from dynamo.runtime import DistributedRuntime  # noqa: F401
    except ImportError as exc:
        raise DynamoSetupError(
            f"serving under NVIDIA Dynamo needs its runtime ({DYNAMO_DISTRIBUTION}), which this "
            f"environment lacks ({exc.msg}): {DYNAMO_EXTRA}"
        ) from None


@dataclass(frozen=True)
class DynamoSettings:
    """Where a role serves and how it reaches the others (the flags of ``cli.py``)."""

    namespace: str
    component: str
    endpoint: str
    discovery_backend: str
    request_plane: str
    event_plane: str | None = None

    @property
    def model_path(self) -> str:
        """The endpoint the served model is registered on (pipeline and router roles)."""
        return f"{self.namespace}.{self.component}.{self.endpoint}"

    def stage_path(self, stage_id: int) -> str:
        """The endpoint of stage ``stage_id``'s workers, where routers of this deployment find them."""
        return f"{self.namespace}.{self.component}-stage{stage_id}.{self.endpoint}"


def make_runtime(settings: DynamoSettings) -> Any:
    """The ``DistributedRuntime`` of this process, on the running event loop."""
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    try:
        return DistributedRuntime(
            loop, settings.discovery_backend, settings.request_plane, event_plane=settings.event_plane
        )
    except Exception as exc:  # Rust's error: no etcd there, a bad backend name, a port in use
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DynamoSetupError(
            f"cannot start Dynamo's runtime (discovery {settings.discovery_backend}, request plane "
            f"{settings.request_plane}): {reason}"
        ) from None


def error_for(status: int, message: str) -> Exception:
    """The Dynamo exception a failed request of this HTTP status raises (``request_fields.dynamo_error``)."""
    import dynamo.llm.exceptions as dynamo_exceptions

    return getattr(dynamo_exceptions, dynamo_error(status))(message)


class Replies:
    """What a request handler gives Dynamo: the replies ``work`` (a coroutine) returns, one per
    ``__anext__``. A failure reaches Dynamo on a future rather than through a Python frame: Dynamo prints
    every failure a handler raises, with the traceback of the frames it passed, and this one has none, so
    it is one line (the handler has logged it already, with the request's id)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, work: Coroutine[Any, Any, list[Any]]) -> None:
        self.loop = loop
        self.work = work
        self.replies: list[Any] | None = None

    def __aiter__(self) -> Replies:
        return self

    def __anext__(self) -> asyncio.Future[Any]:
        # Dynamo asks from a thread of its own: the answer is computed on the loop.
        future = self.loop.create_future()
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._next(future)))
        return future

    async def _next(self, future: asyncio.Future[Any]) -> None:
        try:
            if self.replies is None:
                self.replies = list(await self.work)
            if not self.replies:
                raise StopAsyncIteration
            reply = self.replies.pop(0)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:  # StopAsyncIteration too: the end of the replies
            exc.__traceback__ = None
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(reply)


async def until_stopped(context: Any) -> None:
    """Returns when Dynamo stops the request (its client went away, or its caller stopped it)."""
    await context.async_killed_or_stopped()


def expose_metrics(endpoint: Any, collect: Callable[[], str]) -> None:
    """Our Prometheus text beside Dynamo's own on the worker's system port (``DYN_SYSTEM_PORT``)."""

    def text() -> str:
        try:
            return collect()
        except Exception:  # a scrape must not fail the worker
            logger.exception("collecting the omni metrics failed")
            return ""

    endpoint.metrics.register_prometheus_expfmt_callback(text)


def stop_on_signals(runtime: Any, on_stop: Callable[[str], None] | None = None) -> asyncio.Event:
    """SIGINT/SIGTERM shut the runtime down (its endpoints stop taking requests and finish theirs); the
    event is set then."""
    import signal

    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def stop(sig: signal.Signals) -> None:
        if stopping.is_set():
            return
        stopping.set()
        logger.info("%s received; stopping", sig.name)
        if on_stop is not None:
            on_stop(sig.name)
        runtime.shutdown()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig)
    return stopping


async def serve(endpoint: Any, handler: Any, stopping: asyncio.Event) -> None:
    """Serve ``endpoint`` until the runtime shuts down (Dynamo's call returns a future)."""
    served = asyncio.ensure_future(endpoint.serve_endpoint(handler, graceful_shutdown=True))
    waiting = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({served, waiting}, return_when=asyncio.FIRST_COMPLETED)
    if not served.done():
        # the runtime drains what the endpoint still serves, then its future completes
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(served), 60)
    waiting.cancel()
    error = served.exception() if served.done() and not served.cancelled() else None
    if error is not None:
        raise error
