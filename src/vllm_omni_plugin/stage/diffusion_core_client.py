"""Diffusion stage clients: ``StageDiffusionCoreClient`` (a ``StageDiffusionCoreProc`` over ZMQ) and
``InlineStageDiffusionClient`` (the diffusion engine in this process: the batch loop on a worker thread)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from typing import Any

import msgspec

from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_plugin.log import best_effort, get_logger
from vllm_omni_plugin.processes import ProcessTree
from vllm_omni_plugin.runtime_dir import runtime_dir
from vllm_omni_plugin.stage.core_client import StageCoreClientBase, StageState
from vllm_omni_plugin.stage.core_types import (
    PROGRESS_REPORT_INTERVAL_S,
    FromStageMessage,
    StageAbort,
    StageCoreOutputs,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageDropped,
    StageFailed,
    StagePreview,
    StageProgress,
    StageReady,
    StageShutdown,
    ToStageMessage,
)
from vllm_omni_plugin.stage.diffusion_core_proc import StageDiffusionCoreProcManager, StageDiffusionProcConfig
from vllm_omni_plugin.stage.diffusion_loop import DiffusionBatchLoop, batch_prefix
from vllm_omni_plugin.stage.errors import (
    RequestAbortedError,
    StageDeadError,
    StageError,
    StageRequestError,
    StageStartError,
)
from vllm_omni_plugin.stage.payload import (
    collect_output,
    discard_output,
    released_if_replica_dies,
    send_request_through,
)
from vllm_omni_plugin.stage.pending_replies import PendingReplies
from vllm_omni_plugin.stage.request_events import DenoiseProgress, PreviewImage, publish
from vllm_omni_plugin.stage.serialization import StageMessageCodec

logger = get_logger(__name__)

READY_TIMEOUT_S = 600.0
WATCH_INTERVAL_S = 0.2
EXIT_GRACE_S = 10.0
"""How long a stopped stage process gets to exit (after SIGTERM) before SIGKILL."""
ARRIVED_POLLS = 200
"""At most this many 10 ms turns for the reader to take what a dead process sent before it died."""
DEATH_NOTICE_S = 5.0
"""How long a request that found its process disconnected waits for the watch to notice the death."""


class StageDiffusionCoreClient(StageCoreClientBase):
    """Talks to one ``StageDiffusionCoreProc``; restarts it when it dies, failing only its in-flight
    requests."""

    def __init__(
        self,
        config: StageDiffusionProcConfig,
        *,
        name: str = "dit",
        output_connector: Any = None,
        input_connector: Any = None,
        restart: bool = True,
    ) -> None:
        super().__init__(config.stage_id, config.replica_id, name, restart=restart)
        base = os.path.join(runtime_dir(), f"vllm_omni_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        config.input_address = f"ipc://{base}_in"
        config.output_address = f"ipc://{base}_out"
        self.config = config
        self.manager = StageDiffusionCoreProcManager(config)
        self.processes = ProcessTree(self.label)
        """The stage process and the shared memory it maps (removed once it is gone)."""
        self.output_connector = output_connector
        self.input_connector = input_connector
        self._to_stage = StageMessageCodec(ToStageMessage)
        self._from_stage = StageMessageCodec(FromStageMessage)
        self._pending = PendingReplies(self)
        self._alone: set[str] = set()
        """Waiting requests that run alone (``StageDiffusionCoreRequest.alone``)."""
        self._ready: asyncio.Future[StageReady] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._context: Any = None
        self._push: Any = None
        self._pull: Any = None

    @property
    def pid(self) -> int | None:
        return self.manager.pid

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._context = zmq.asyncio.Context()
        self._push = self._context.socket(zmq.PUSH)
        self._push.bind(self.config.input_address)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(self.config.output_address)
        self._tasks.append(asyncio.create_task(self._read_outputs(), name=f"{self.label} outputs"))
        await self._launch()
        self._tasks.append(asyncio.create_task(self._watch(), name=f"{self.label} watch"))

    async def _launch(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        await loop.run_in_executor(None, self._start_process)
        logger.info("%s launched (pid %s); loading", self.label, self.manager.pid)
        self.launched.set()
        deadline = loop.time() + READY_TIMEOUT_S
        while not self._ready.done():
            if not self.manager.is_alive():
                raise StageStartError(
                    f"{self.label} exited with code {self.manager.exitcode} while loading",
                    stage_id=self.stage_id,
                )
            if loop.time() > deadline:
                raise StageStartError(f"{self.label} not ready after {READY_TIMEOUT_S:.0f}s")
            await asyncio.wait({self._ready}, timeout=WATCH_INTERVAL_S)
        ready = self._ready.result()
        self.weight_bytes = ready.weight_bytes
        await asyncio.to_thread(self.processes.record, self.manager.pid)
        self.state = StageState.READY
        logger.info(
            "%s ready on %s (pid %d, loaded in %.2fs)",
            self.label,
            ready.device,
            ready.pid,
            ready.load_seconds,
        )

    def _start_process(self) -> None:
        self.manager.start()
        self.processes = ProcessTree(self.label).record(self.manager.pid)

    def _stop_process(self) -> None:
        """Stop the stage process (if it still runs) and remove the shared memory it left."""
        self.manager.stop(EXIT_GRACE_S)
        self.processes.stop(EXIT_GRACE_S)

    async def _read_outputs(self) -> None:
        while True:
            frame = await self._pull.recv()
            try:
                message = self._from_stage.decode(frame)
            except msgspec.DecodeError:
                logger.error("%s sent an undecodable message; dropped", self.label)
                continue
            if isinstance(message, StageReady | StageFailed):
                if self._ready is not None and not self._ready.done():
                    if isinstance(message, StageFailed):
                        self._ready.set_exception(
                            StageStartError(
                                f"{self.label} failed to start: {message.error}", stage_id=self.stage_id
                            )
                        )
                    else:
                        self._ready.set_result(message)
                continue
            if message.pid != self.manager.pid:  # sent by a process that died since: its requests ran again
                if isinstance(message, StageCoreOutputs):
                    for output in message.outputs:
                        discard_output(output, self.output_connector)
                continue
            if isinstance(message, StageDropped):
                self.dropped[message.where] += len(message.request_ids)
                continue
            if isinstance(message, StageProgress):
                self.count_steps(message.counters)
                for request_id, (done, total) in message.steps.items():
                    publish(request_id, DenoiseProgress(self.stage_id, done, total))
                continue
            if isinstance(message, StagePreview):
                publish(message.request_id, PreviewImage(self.stage_id, message.index, message.image))
                continue
            for output in message.outputs:
                if not self._pending.resolve(output.request_id, output):
                    self.discarded_outputs += 1
                    discard_output(output, self.output_connector)  # aborted meanwhile

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.state != StageState.READY or self.manager.is_alive():
                continue
            await self._read_what_arrived()
            error = self.replica_died(f"exit code {self.manager.exitcode}")
            self._pending.fail_all(error, errors=self._queued_at_death(error))
            await asyncio.to_thread(self._stop_process)
            if not self.restart_on_death or self.state == StageState.STOPPED:
                return
            try:
                self.restarts += 1
                self.count_steps_anew()
                await self._launch()
            except StageError as exc:
                logger.error("%s could not be restarted: %s", self.label, exc)
                self.state = StageState.DEAD
                return

    async def _read_what_arrived(self) -> None:
        """Let the reader take what the dead process sent before it died: a request whose output waits
        on our socket was answered, and must not be taken for one it was running when it died."""
        import zmq

        for _ in range(ARRIVED_POLLS):
            if not self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            await asyncio.sleep(0.01)

    def _queued_at_death(self, death: StageDeadError) -> dict[str, BaseException]:
        """The error of each request the dead process cannot have been running: it takes its batches in
        the order it got them (``batch_prefix``), so past the first batch of what it had not answered,
        requests still waited in its queue. Those are told so (``ran=False``): they cannot have caused
        the death, and their runs again cost them no retry."""
        waiting = self._pending.order()
        args = self.config.diffusion_args
        limit = int(args.get("max_batch_size", 1))
        if args.get("batching") in (None, "loop") and args.get("scheduling_policy") == "priority":
            limit *= 2  # better requests join a full step loop (parked ones stay in it)
        running = batch_prefix([i in self._alone for i in waiting], limit)
        message = f"{death} (this request still waited in its queue)"
        return {
            i: StageDeadError(message, stage_id=self.stage_id, request_id=i, where="queued")
            for i in waiting[running:]
        }

    async def generate(self, request: StageDiffusionCoreRequest) -> StageDiffusionCoreOutput:
        if self.state != StageState.READY:
            raise StageDeadError(
                f"{self.label} is {self.state.value}", stage_id=self.stage_id, where="unsent"
            )
        request, put_seconds = send_request_through(request, self.input_connector)
        if request.alone:
            self._alone.add(request.request_id)
        try:
            with released_if_replica_dies(request, self.input_connector):
                output: StageDiffusionCoreOutput = await self._pending.wait(
                    request.request_id, self._send(request)
                )
        finally:
            self._alone.discard(request.request_id)
        output.timings["transfer_put"] = put_seconds
        collect_output(output, self.output_connector)
        if output.error is not None:
            error = StageRequestError if output.invalid else StageError
            raise error(output.error, stage_id=self.stage_id, request_id=request.request_id)
        return output

    async def _send(self, message: Any) -> None:
        """Hand ``message`` to the stage process now, or fail: a message must never wait in the socket
        for a process that is not connected, or a restarted process would get what was meant for the
        dead one."""
        import zmq

        try:
            await self._push.send(self._to_stage.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            # Its process is gone: let the watch see it first, so the pool does not pick it again.
            deadline = asyncio.get_running_loop().time() + DEATH_NOTICE_S
            while self.state == StageState.READY and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(WATCH_INTERVAL_S / 4)
            raise StageDeadError(
                f"{self.label} is not connected (its process died)", stage_id=self.stage_id, where="unsent"
            ) from None

    async def abort(self, request_ids: list[str]) -> None:
        self._pending.fail(request_ids)
        if self._push is not None and self.state == StageState.READY:
            with contextlib.suppress(StageDeadError):
                await self._send(StageAbort(request_ids=list(request_ids)))

    async def shutdown(self) -> None:
        self.state = StageState.STOPPED
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._push is not None and self.manager.is_alive():
            with best_effort("sending StageShutdown to the diffusion process", logger):
                await asyncio.wait_for(self._push.send(self._to_stage.encode(StageShutdown())), 1.0)
        await asyncio.to_thread(self._stop_process)
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if self._context is not None:
            self._context.term()
        self._pending.fail_all(RequestAbortedError("the stage is shutting down", stage_id=self.stage_id))
        for address in (self.config.input_address, self.config.output_address):
            with contextlib.suppress(OSError):
                os.unlink(address.removeprefix("ipc://"))


class InlineStageDiffusionClient(StageCoreClientBase):
    """The diffusion engine in this process: the replica's batch loop on one worker thread, its results
    handed to asyncio futures. With connectors (a Ray actor's) payloads arrive and images leave through
    them."""

    def __init__(
        self,
        stage_id: int,
        replica_id: int,
        diffusion_args: dict[str, Any],
        *,
        name: str = "dit",
        input_connector: Any = None,
        output_connector: Any = None,
    ) -> None:
        super().__init__(stage_id, replica_id, name)
        self.diffusion_args = dict(diffusion_args)
        self.input_connector = input_connector
        self.output_connector = output_connector
        self._thread: threading.Thread | None = None
        self._loop: DiffusionBatchLoop | None = None
        self._waiting: dict[str, tuple[asyncio.Future[Any], asyncio.AbstractEventLoop]] = {}
        """Each request's future and the event loop it waits on, until its output or drop."""

    async def start(self) -> None:
        from vllm_omni_plugin.stage.diffusion_core_proc import load_diffusion_engine

        loop = asyncio.get_running_loop()
        try:
            engine, _device = await loop.run_in_executor(None, load_diffusion_engine, self.diffusion_args)
        except Exception as exc:
            raise StageStartError(f"{self.label} failed to start: {type(exc).__name__}: {exc}") from exc
        self.weight_bytes = engine.weight_bytes
        self._loop = DiffusionBatchLoop(
            engine,
            self.stage_id,
            _FutureReport(self),
            max_batch=int(self.diffusion_args.get("max_batch_size", 1)),
            input_connector=self.input_connector,
            output_connector=self.output_connector,
        )
        self._thread = threading.Thread(target=self._loop.serve, name=f"{self.label}", daemon=True)
        self._thread.start()
        self.state = StageState.READY

    # --- requests ----------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return os.getpid() if self.healthy else None

    async def generate(self, request: StageDiffusionCoreRequest) -> StageDiffusionCoreOutput:
        if self.state != StageState.READY or self._loop is None:
            raise StageDeadError(
                f"{self.label} is {self.state.value}", stage_id=self.stage_id, where="unsent"
            )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[StageDiffusionCoreOutput] = loop.create_future()
        self.inflight.add(request.request_id)
        self._waiting[request.request_id] = (future, loop)
        self._loop.inbox.add(request)
        try:
            output = await future
        except asyncio.CancelledError:
            if not future.done():  # still queued or in its batch: the loop drops it
                self._abort([request.request_id])
            raise
        finally:
            self.inflight.discard(request.request_id)
        if output.error is not None:
            error = StageRequestError if output.invalid else StageError
            raise error(output.error, stage_id=self.stage_id, request_id=request.request_id)
        return output

    def _abort(self, request_ids: list[str]) -> None:
        if self._loop is not None:
            _FutureReport(self).dropped(self._loop.abort(request_ids), "queue")

    async def abort(self, request_ids: list[str]) -> None:
        self._abort([i for i in request_ids if i in self.inflight])  # only what it has: others never come

    async def shutdown(self) -> None:
        self.state = StageState.STOPPED
        if self._loop is None or self._thread is None:
            return
        self._loop.inbox.drain()  # what is queued still runs, as before a stop
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)


class _FutureReport:
    """The loop's reports as the in-process client's futures and counts (called on the loop's thread,
    applied on each request's event loop)."""

    def __init__(self, client: InlineStageDiffusionClient) -> None:
        self.client = client
        self.last_steps = 0.0

    def outputs(self, outputs: list[StageDiffusionCoreOutput]) -> None:
        for output in outputs:
            waiting = self.client._waiting.pop(output.request_id, None)
            if waiting is not None:
                future, loop = waiting
                loop.call_soon_threadsafe(_set_result, future, output)

    def dropped(self, request_ids: list[str], where: str) -> None:
        client = self.client
        for request_id in request_ids:
            waiting = client._waiting.pop(request_id, None)
            if waiting is None:
                continue
            future, loop = waiting
            loop.call_soon_threadsafe(client.dropped.update, [where])
            error = RequestAbortedError("aborted", stage_id=client.stage_id, request_id=request_id)
            loop.call_soon_threadsafe(_set_exception, future, error)

    def progress(
        self, counters: DiffusionCounters, *, force: bool, steps: dict[str, tuple[int, int]] | None = None
    ) -> None:
        self.client.count_steps(counters)  # from the engine's thread: one attribute assignment
        now = time.monotonic()
        if not steps or not (force or now - self.last_steps >= PROGRESS_REPORT_INTERVAL_S):
            return
        self.last_steps = now
        for request_id, (done, total) in steps.items():
            waiting = self.client._waiting.get(request_id)
            if waiting is not None:
                waiting[1].call_soon_threadsafe(
                    publish, request_id, DenoiseProgress(self.client.stage_id, done, total)
                )

    def preview(self, request_id: str, index: int, image: Any) -> None:
        waiting = self.client._waiting.get(request_id)
        if waiting is not None:
            event = PreviewImage(self.client.stage_id, index, image)
            waiting[1].call_soon_threadsafe(publish, request_id, event)


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
