"""Stages on other hosts: headless stage workers and the head they register with.

A stage marked ``headless: true`` in the deploy config is not started by the head. A worker started
with ``vllm serve MODEL --omni --deploy-config F --stage-id N --headless --head ADDR:PORT`` runs that
stage's replicas (a ``StageReplicaPool`` of its own) and registers with the head over ZMQ (TCP). The
head's ``HeadlessStageRegistry`` answers on ``head.port`` and gives each headless stage one
``RemoteStageClient`` in its replica pool, so the orchestrator treats the worker like any replica.

* Registration: the worker sends its stage id and a digest of that stage's deploy config and
  connectors; the head refuses a worker whose digest differs from its own (both hosts must run the
  same file) or whose stage is already served.
* Heartbeats both ways every ``heartbeat_interval_s``. A worker silent for ``heartbeat_timeout_s`` (or
  one that says it is leaving) is detached: its in-flight requests fail with ``StageDeadError``
  (HTTP 503), new requests wait for a worker, and a restarted worker rejoins by registering again.
  A head silent that long, or one that says it shuts down, makes the worker stop its replicas and exit.
* Payloads do not pass through the worker's main process: the stage's connectors are built in the
  replica processes (e.g. NIXL agents that READ from the head's agent, and that the head READs the
  final image from); messages carry only handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import time
import uuid
from typing import Any, Literal

import msgspec

from vllm_omni_plugin.config.resolve import ResolvedDeployment, ResolvedHead
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.core_client import PendingReplies, StageCoreClientBase, StageState
from vllm_omni_plugin.stage.core_types import (
    StageAbort,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageLLMCoreOutput,
    StageLLMCoreRequest,
)
from vllm_omni_plugin.stage.errors import RequestAbortedError, StageDeadError, StageError, StageStartError
from vllm_omni_plugin.stage.payload import collect_output, discard_output, send_request_through
from vllm_omni_plugin.stage.serialization import StageMessageCodec

logger = get_logger(__name__)

REGISTER_RETRY_S = 2.0
WAITING_LOG_S = 30.0


# --- the protocol ---------------------------------------------------------------------------------


class WorkerRegister(msgspec.Struct, kw_only=True, tag="register"):
    stage_id: int
    worker_id: str
    host: str
    pid: int
    config_digest: str


class WorkerAccepted(msgspec.Struct, kw_only=True, tag="accepted"):
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


class WorkerRejected(msgspec.Struct, kw_only=True, tag="rejected"):
    reason: str


class Heartbeat(msgspec.Struct, kw_only=True, tag="heartbeat"):
    pass


class WorkerLeaving(msgspec.Struct, kw_only=True, tag="leaving"):
    reason: str


class HeadShutdown(msgspec.Struct, kw_only=True, tag="head_shutdown"):
    pass


class RemoteRequest(msgspec.Struct, kw_only=True, tag="remote_request"):
    request: StageLLMCoreRequest | StageDiffusionCoreRequest


class RemoteOutput(msgspec.Struct, kw_only=True, tag="remote_output"):
    request_id: str
    output: StageLLMCoreOutput | StageDiffusionCoreOutput | None = None
    error: str | None = None
    error_kind: Literal["stage", "dead", "aborted"] | None = None


HeadMessage = WorkerAccepted | WorkerRejected | Heartbeat | HeadShutdown | RemoteRequest | StageAbort
WorkerMessage = WorkerRegister | Heartbeat | WorkerLeaving | RemoteOutput


def stage_config_digest(deployment: ResolvedDeployment, stage_id: int) -> str:
    """What head and worker must agree on: the pipeline, the stage's deploy config and its connectors."""
    stage = next(s for s in deployment.deploy.stages if s.stage_id == stage_id)
    resolved = next(s for s in deployment.stages if s.stage_id == stage_id)
    names = {*resolved.input_connectors.values(), *resolved.output_connectors.values()}
    connectors = {name: deployment.connectors[name] for name in sorted(names)}
    blob = msgspec.json.encode([deployment.pipeline, stage, connectors])
    return hashlib.sha256(blob).hexdigest()[:16]


def parse_head_address(text: str) -> tuple[str, int]:
    """``ADDR:PORT`` (``[v6addr]:PORT`` for IPv6) -> (host, port); ValueError with the reason."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--head {text!r}: expected ADDR:PORT, e.g. 10.0.0.1:29600")
    return host, int(port)


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# --- the head -------------------------------------------------------------------------------------


class RemoteStageClient(StageCoreClientBase):
    """The head's view of a headless stage: one worker (of any number of replicas) once registered."""

    def __init__(
        self,
        stage_id: int,
        name: str,
        *,
        input_connector: Any = None,
        output_connector: Any = None,
    ) -> None:
        super().__init__(stage_id, 0, name)
        self.input_connector = input_connector
        self.output_connector = output_connector
        self.identity: bytes | None = None
        self.worker: WorkerRegister | None = None
        self.last_seen = 0.0
        self.joins = 0
        self._send: Any = None
        self._pending = PendingReplies(self)

    @property
    def label(self) -> str:
        where = f" worker {self.worker.host} pid {self.worker.pid}" if self.worker else ""
        return f"stage {self.stage_id} ({self.name}){where}"

    @property
    def remote_pid(self) -> int | None:
        return self.worker.pid if self.worker is not None and self.identity is not None else None

    @property
    def awaits_worker(self) -> bool:
        return self.state in (StageState.STARTING, StageState.RESTARTING)

    async def start(self) -> None:
        """Nothing to start here: the worker comes to us (requests wait for it meanwhile)."""

    def attach(self, identity: bytes, worker: WorkerRegister, send: Any) -> None:
        self.identity, self.worker, self._send = identity, worker, send
        self.last_seen = time.monotonic()
        self.joins += 1
        self.restarts = self.joins - 1
        self.state = StageState.READY
        logger.info("%s registered (join %d)", self.label, self.joins)

    def detach(self, why: str) -> None:
        if self.identity is None:
            return
        logger.error("%s %s; failing %d in-flight request(s)", self.label, why, len(self._pending))
        error = StageDeadError(
            f"{self.label} {why} while serving this request; waiting for the worker to rejoin",
            stage_id=self.stage_id,
        )
        self._pending.fail_all(error)
        self.identity = None
        if self.state != StageState.STOPPED:
            self.state = StageState.RESTARTING

    def deliver(self, message: RemoteOutput) -> None:
        if not self._pending.resolve(message.request_id, message):
            discard_output(message.output, self.output_connector)  # aborted meanwhile

    async def generate(self, request: Any) -> Any:
        if self.state != StageState.READY or self.identity is None:
            raise StageDeadError(f"{self.label} has no worker registered", stage_id=self.stage_id)
        request, put_seconds = send_request_through(request, self.input_connector)
        message: RemoteOutput = await self._pending.wait(
            request.request_id, self._send(self.identity, RemoteRequest(request=request))
        )
        if message.error is not None or message.output is None:
            error = message.error or "the worker returned no output"
            kind = {"dead": StageDeadError, "aborted": RequestAbortedError}.get(
                message.error_kind or "", StageError
            )
            raise kind(f"{self.label}: {error}", stage_id=self.stage_id, request_id=request.request_id)
        output = message.output
        output.timings["transfer_put"] = put_seconds
        collect_output(output, self.output_connector)
        return output

    async def abort(self, request_ids: list[str]) -> None:
        self._pending.fail(request_ids)
        if self.identity is not None and self._send is not None:
            with contextlib.suppress(Exception):
                await self._send(self.identity, StageAbort(request_ids=list(request_ids)))

    async def shutdown(self) -> None:
        self.state = StageState.STOPPED
        self._pending.fail_all(RequestAbortedError("the head is shutting down", stage_id=self.stage_id))


class HeadlessStageRegistry:
    """The head's side: accepts workers for its headless stages, relays their messages, watches them."""

    def __init__(self, deployment: ResolvedDeployment, clients: dict[int, RemoteStageClient]) -> None:
        self.deployment = deployment
        self.head: ResolvedHead = deployment.head
        self.clients = clients
        self.digests = {sid: stage_config_digest(deployment, sid) for sid in clients}
        self._codec_out = StageMessageCodec(HeadMessage)
        self._codec_in = StageMessageCodec(WorkerMessage)
        self._context: Any = None
        self._router: Any = None
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def address(self) -> str:
        return _tcp(self.head.host, self.head.port)

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._context = zmq.asyncio.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            self._router.bind(self.address)
        except zmq.ZMQError as exc:
            self._router.close(linger=0)
            self._context.term()
            raise StageStartError(
                f"cannot accept headless stage workers on {self.address}: {exc} (set head.port in the "
                "deploy config to a free port)"
            ) from None
        self._tasks = [
            asyncio.create_task(self._receive(), name="headless registry"),
            asyncio.create_task(self._heartbeat(), name="headless heartbeats"),
        ]
        for sid, client in self.clients.items():
            logger.info(
                "stage %d (%s) is headless: waiting for its worker on %s (on the worker host: vllm serve "
                "MODEL --omni --deploy-config FILE --stage-id %d --headless --head THIS_HOST:%d)",
                sid,
                client.name,
                self.address,
                sid,
                self.head.port,
            )

    async def send(self, identity: bytes, message: Any) -> None:
        await self._router.send_multipart([identity, self._codec_out.encode(message)])

    async def _receive(self) -> None:
        while True:
            identity, frame = await self._router.recv_multipart()
            try:
                message = self._codec_in.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("dropped an undecodable message from a headless worker: %s", exc)
                continue
            if isinstance(message, WorkerRegister):
                await self._register(identity, message)
                continue
            client = self._client_of(identity)
            if client is None:
                if not isinstance(message, WorkerLeaving):
                    await self.send(identity, WorkerRejected(reason="not registered with this head"))
                continue
            client.last_seen = time.monotonic()
            if isinstance(message, RemoteOutput):
                client.deliver(message)
            elif isinstance(message, WorkerLeaving):
                client.detach(f"left ({message.reason})")

    async def _register(self, identity: bytes, worker: WorkerRegister) -> None:
        client = self.clients.get(worker.stage_id)
        reason = None
        if client is None:
            headless = sorted(self.clients) or "none"
            reason = (
                f"stage {worker.stage_id} is not a headless stage of this deployment (headless: {headless})"
            )
        elif worker.config_digest != self.digests[worker.stage_id]:
            reason = (
                f"the worker's deploy config for stage {worker.stage_id} differs from the head's "
                "(stage settings or connectors); start both with the same file"
            )
        elif client.identity is not None and client.identity != identity:
            reason = f"stage {worker.stage_id} is already served by {client.label}"
        if reason is not None:
            logger.warning("refused a worker from %s (pid %d): %s", worker.host, worker.pid, reason)
            await self.send(identity, WorkerRejected(reason=reason))
            return
        assert client is not None
        if client.identity != identity:  # not a repeated registration of the attached worker
            client.attach(identity, worker, self.send)
        await self.send(
            identity,
            WorkerAccepted(
                heartbeat_interval_s=self.head.heartbeat_interval_s,
                heartbeat_timeout_s=self.head.heartbeat_timeout_s,
            ),
        )

    def _client_of(self, identity: bytes) -> RemoteStageClient | None:
        return next((c for c in self.clients.values() if c.identity == identity), None)

    async def _heartbeat(self) -> None:
        tick = time.monotonic()
        while True:
            await asyncio.sleep(self.head.heartbeat_interval_s)
            now, last_tick, tick = time.monotonic(), tick, time.monotonic()
            for client in self.clients.values():
                if client.identity is None:
                    continue
                if now - last_tick > self.head.heartbeat_timeout_s:
                    client.last_seen = now  # this loop was stalled, not the worker: start over
                elif now - client.last_seen > self.head.heartbeat_timeout_s:
                    client.detach(f"sent nothing for {self.head.heartbeat_timeout_s:.0f} s")
                    continue
                with contextlib.suppress(Exception):
                    await self.send(client.identity, Heartbeat())

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for client in self.clients.values():
            if client.identity is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.send(client.identity, HeadShutdown()), 1.0)
        if self._router is not None:
            self._router.close(linger=500)
        if self._context is not None:
            self._context.term()


# --- the worker -----------------------------------------------------------------------------------


class HeadlessStageWorker:
    """Runs one stage's replicas here and serves them to a head; ``run()`` returns the exit code."""

    def __init__(self, deployment: ResolvedDeployment, stage_id: int, head_address: str) -> None:
        self.deployment = deployment
        self.stage_id = stage_id
        self.head_host, self.head_port = parse_head_address(head_address)
        self.head_url = _tcp(self.head_host, self.head_port)
        self.worker_id = uuid.uuid4().hex[:12]
        self._codec_out = StageMessageCodec(WorkerMessage)
        self._codec_in = StageMessageCodec(HeadMessage)
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._dealer: Any = None
        self._stopping: asyncio.Future[tuple[int, str]] | None = None
        self._leaving = False
        """Stopped by a signal: tell the head we go, so it fails our requests at once."""

    async def run(self) -> int:
        import zmq
        import zmq.asyncio

        from vllm_omni_plugin.entrypoints.omni import build_pools

        loop = asyncio.get_running_loop()
        self._stopping = loop.create_future()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        stage = next(s for s in self.deployment.stages if s.stage_id == self.stage_id)
        # No connectors in this process: the replica processes build them and messages pass through.
        pool = build_pools(self.deployment, {}, [self.stage_id], headless_worker=True)[self.stage_id]
        context = zmq.asyncio.Context()
        self._dealer = context.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        code, why = 1, "stopped"
        try:
            start = asyncio.ensure_future(pool.start())
            await asyncio.wait({start, self._stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not start.done():
                start.cancel()
                code, why = self._stopping.result()
                return code
            start.result()
            logger.info(
                "stage %d (%s) loaded with %d replica(s); registering with the head at %s",
                self.stage_id,
                stage.name,
                len(pool.clients),
                self.head_url,
            )
            self._dealer.connect(self.head_url)
            accepted = await self._register()
            if accepted is None:
                code, why = self._stopping.result()
                return code
            logger.info("registered with the head at %s; serving stage %d", self.head_url, self.stage_id)
            serve = asyncio.ensure_future(self._serve(pool, accepted))
            await asyncio.wait({serve, self._stopping}, return_when=asyncio.FIRST_COMPLETED)
            serve.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serve
            code, why = self._stopping.result()
            if self._leaving:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._send(WorkerLeaving(reason=why)), 1.0)
            return code
        finally:
            for task in list(self._tasks.values()):
                task.cancel()
            await pool.shutdown()
            self._dealer.close(linger=0)
            context.term()
            log = logger.info if code == 0 else logger.error
            log("headless worker for stage %d exiting: %s", self.stage_id, why)

    def _on_signal(self, sig: int) -> None:
        if self._stopping is not None and not self._stopping.done():
            self._leaving = True
            self._stop(0, f"{signal.Signals(sig).name} received")

    def _stop(self, code: int, why: str) -> None:
        if self._stopping is not None and not self._stopping.done():
            self._stopping.set_result((code, why))

    async def _send(self, message: Any) -> None:
        await self._dealer.send(self._codec_out.encode(message))

    async def _register(self) -> WorkerAccepted | None:
        assert self._stopping is not None
        register = WorkerRegister(
            stage_id=self.stage_id,
            worker_id=self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            config_digest=stage_config_digest(self.deployment, self.stage_id),
        )
        waited = 0.0
        while not self._stopping.done():
            await self._send(register)
            if await self._dealer.poll(REGISTER_RETRY_S * 1000):
                message = self._codec_in.decode(await self._dealer.recv())
                if isinstance(message, WorkerAccepted):
                    return message
                if isinstance(message, WorkerRejected):
                    self._stop(1, f"the head at {self.head_url} refused this worker: {message.reason}")
                    return None
                continue
            waited += REGISTER_RETRY_S
            if waited % WAITING_LOG_S < REGISTER_RETRY_S:
                logger.info("still waiting for the head at %s (%.0f s)", self.head_url, waited)
        return None

    async def _serve(self, pool: Any, accepted: WorkerAccepted) -> None:
        last_heard = time.monotonic()

        async def heartbeat() -> None:
            nonlocal last_heard
            tick = time.monotonic()
            while True:
                await asyncio.sleep(accepted.heartbeat_interval_s)
                now, last_tick, tick = time.monotonic(), tick, time.monotonic()
                if now - last_tick > accepted.heartbeat_timeout_s:
                    last_heard = now  # this loop was stalled, not the head: start over
                elif now - last_heard > accepted.heartbeat_timeout_s:
                    self._stop(
                        1,
                        f"the head at {self.head_url} sent nothing for {accepted.heartbeat_timeout_s:.0f} s",
                    )
                    return
                await self._send(Heartbeat())

        beat = asyncio.create_task(heartbeat(), name="heartbeat to head")
        try:
            while True:
                message = self._codec_in.decode(await self._dealer.recv())
                last_heard = time.monotonic()
                if isinstance(message, RemoteRequest):
                    request = message.request
                    self._tasks[request.request_id] = asyncio.create_task(self._generate(pool, request))
                elif isinstance(message, StageAbort):
                    for request_id in message.request_ids:
                        task = self._tasks.pop(request_id, None)
                        if task is not None:
                            task.cancel()
                    await pool.abort(list(message.request_ids))
                elif isinstance(message, HeadShutdown):
                    self._stop(0, "the head shut down")
                    return
                elif isinstance(message, WorkerRejected):  # the head restarted and forgot us
                    self._stop(
                        1, f"the head at {self.head_url} no longer knows this worker ({message.reason})"
                    )
                    return
        finally:
            beat.cancel()

    async def _generate(self, pool: Any, request: Any) -> None:
        reply = RemoteOutput(request_id=request.request_id)
        try:
            reply.output = await pool.generate(request)
        except asyncio.CancelledError:
            return
        except StageDeadError as exc:
            reply.error, reply.error_kind = str(exc), "dead"
        except RequestAbortedError as exc:
            reply.error, reply.error_kind = str(exc), "aborted"
        except StageError as exc:
            reply.error, reply.error_kind = str(exc), "stage"
        except Exception as exc:  # reported to the head as this request's failure
            logger.exception("request %s failed on this worker", request.request_id)
            reply.error, reply.error_kind = f"{type(exc).__name__}: {exc}", "stage"
        finally:
            self._tasks.pop(request.request_id, None)
        await self._send(reply)


def run_headless_worker(deployment: ResolvedDeployment, stage_id: int, head_address: str) -> int:
    return asyncio.run(HeadlessStageWorker(deployment, stage_id, head_address).run())
