"""Stages on other hosts, the head's side: the protocol headless stage workers speak, and the registry
and client through which the head serves their stages (the worker is ``headless_worker``).

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
import time
from typing import Any, Literal

import msgspec

from vllm_omni_plugin.config.resolved import ResolvedDeployment, ResolvedHead
from vllm_omni_plugin.connectors.base import OmniConnector
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.core_client import StageCoreClientBase, StageState
from vllm_omni_plugin.stage.core_types import (
    StageAbort,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageLLMCoreOutput,
    StageLLMCoreRequest,
)
from vllm_omni_plugin.stage.errors import (
    RequestAbortedError,
    StageDeadError,
    StageError,
    StageRequestError,
    StageStartError,
    WorkerLostError,
)
from vllm_omni_plugin.stage.payload import collect_output, discard_output, send_request_through
from vllm_omni_plugin.stage.pending_replies import PendingReplies
from vllm_omni_plugin.stage.serialization import StageMessageCodec

logger = get_logger(__name__)


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


class WorkerProgress(msgspec.Struct, kw_only=True, tag="worker_progress"):
    """The worker's running count of denoising steps (all its replicas), sent while it changes."""

    denoise_steps: int


class HeadShutdown(msgspec.Struct, kw_only=True, tag="head_shutdown"):
    pass


class RemoteRequest(msgspec.Struct, kw_only=True, tag="remote_request"):
    request: StageLLMCoreRequest | StageDiffusionCoreRequest


ErrorKind = Literal["stage", "request", "dead", "aborted"]


class RemoteOutput(msgspec.Struct, kw_only=True, tag="remote_output"):
    request_id: str
    output: StageLLMCoreOutput | StageDiffusionCoreOutput | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    """Which ``StageError`` the worker's stage raised, so the head raises (and answers) the same."""


ERROR_KINDS: dict[ErrorKind, type[StageError]] = {
    "stage": StageError,
    "request": StageRequestError,
    "dead": StageDeadError,
    "aborted": RequestAbortedError,
}
"""``RemoteOutput.error_kind`` -> the error the head raises."""


def remote_stage_output(
    message: RemoteOutput, label: str, stage_id: int, put_seconds: float, connector: OmniConnector | None
) -> StageLLMCoreOutput | StageDiffusionCoreOutput:
    """The stage output a remote replica answered with (its image collected), or the error its stage
    raised, raised here as the same ``StageError`` class."""
    if message.error is not None or message.output is None:
        kind = ERROR_KINDS[message.error_kind] if message.error_kind else StageError
        error = message.error or "the replica returned no output"
        raise kind(f"{label}: {error}", stage_id=stage_id, request_id=message.request_id)
    output = message.output
    output.timings["transfer_put"] = put_seconds
    collect_output(output, connector)
    return output


def error_kind(exc: StageError) -> ErrorKind:
    """The most specific ``RemoteOutput.error_kind`` for ``exc``."""
    return next(kind for kind, cls in reversed(ERROR_KINDS.items()) if isinstance(exc, cls))


HeadMessage = WorkerAccepted | WorkerRejected | Heartbeat | HeadShutdown | RemoteRequest | StageAbort
WorkerMessage = WorkerRegister | Heartbeat | WorkerLeaving | RemoteOutput | WorkerProgress


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


def tcp_address(host: str, port: int) -> str:
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
        super().__init__(stage_id, 0, name, restart=False)
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
    def pid(self) -> int | None:
        """The registered worker's pid, on its own host."""
        return self.worker.pid if self.worker is not None and self.identity is not None else None

    @property
    def awaits_worker(self) -> bool:
        return self.state in (StageState.STARTING, StageState.RESTARTING)

    def health(self) -> dict[str, Any]:
        worker = self.worker
        where = f"{worker.host} pid {worker.pid}" if worker is not None and self.healthy else None
        return {**super().health(), "worker": where}

    async def start(self) -> None:
        """Nothing to start here: the worker comes to us (requests wait for it meanwhile)."""

    def attach(self, identity: bytes, worker: WorkerRegister, send: Any) -> None:
        self.identity, self.worker, self._send = identity, worker, send
        self.last_seen = time.monotonic()
        self.joins += 1
        self.restarts = self.joins - 1
        self.count_steps_anew()
        self.state = StageState.READY
        logger.info("%s registered (join %d)", self.label, self.joins)

    def detach(self, why: str) -> None:
        if self.identity is None:
            return
        logger.error("%s %s; failing %d in-flight request(s)", self.label, why, len(self._pending))
        error = WorkerLostError(
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
        return remote_stage_output(message, self.label, self.stage_id, put_seconds, self.output_connector)

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
        return tcp_address(self.head.host, self.head.port)

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
            elif isinstance(message, WorkerProgress):
                client.count_steps(message.denoise_steps)
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
