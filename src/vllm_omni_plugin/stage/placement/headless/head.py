"""Stages on other hosts, the head's side: the placement, registry and client through which the head
serves its headless stages (the worker is ``worker.py``, what both say ``protocol.py``).

A stage marked ``headless: true`` in the deploy config is not started by the head. A worker started
with ``vllm serve MODEL --omni --deploy-config F --stage-id N --headless --head ADDR:PORT`` runs that
stage's replicas (a ``StageReplicaPool`` of its own) and registers with the head over ZMQ (TCP). The
head's ``HeadlessPlacement`` gives each headless stage one ``RemoteStageClient`` in its replica pool, so
the orchestrator treats the worker like any replica, and once the head's other stages run, its
``HeadlessStageRegistry`` answers on ``head.port``.

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
from typing import Any

import msgspec

from vllm_omni_plugin.config.resolved import ResolvedDeployment, ResolvedHead, ResolvedStage
from vllm_omni_plugin.connectors.base import OmniConnector
from vllm_omni_plugin.log import best_effort, get_logger
from vllm_omni_plugin.stage.core_client import StageCoreClientBase, StageState
from vllm_omni_plugin.stage.core_types import StageAbort
from vllm_omni_plugin.stage.errors import (
    RequestAbortedError,
    StageDeadError,
    StageStartError,
    WorkerLostError,
)
from vllm_omni_plugin.stage.payload import discard_output, released_if_replica_dies, send_request_through
from vllm_omni_plugin.stage.pending_replies import PendingReplies
from vllm_omni_plugin.stage.placement.base import StageConnectors, StagePlacement
from vllm_omni_plugin.stage.placement.headless.protocol import (
    HeadMessage,
    HeadShutdown,
    Heartbeat,
    PeerSilence,
    RemoteRequest,
    WorkerAccepted,
    WorkerLeaving,
    WorkerMessage,
    WorkerProgress,
    WorkerRegister,
    WorkerRejected,
    stage_config_digest,
    tcp_address,
)
from vllm_omni_plugin.stage.placement.wire import RemoteOutput, remote_stage_output
from vllm_omni_plugin.stage.serialization import StageMessageCodec

logger = get_logger(__name__)


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
        self.silence: PeerSilence | None = None
        """How long the registered worker has been silent."""
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

    def attach(
        self,
        identity: bytes,
        worker: WorkerRegister,
        send: Any,
        *,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
    ) -> None:
        self.identity, self.worker, self._send = identity, worker, send
        self.silence = PeerSilence(heartbeat_interval_s, heartbeat_timeout_s)
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
            raise StageDeadError(
                f"{self.label} has no worker registered", stage_id=self.stage_id, where="unsent"
            )
        request, put_seconds = send_request_through(request, self.input_connector)
        with released_if_replica_dies(request, self.input_connector):
            message: RemoteOutput = await self._pending.wait(
                request.request_id, self._send(self.identity, RemoteRequest(request=request))
            )
        return remote_stage_output(message, self.label, self.stage_id, put_seconds, self.output_connector)

    async def abort(self, request_ids: list[str]) -> None:
        self._pending.fail(request_ids)
        if self.identity is not None and self._send is not None:
            with best_effort("sending an abort to a headless worker", logger):
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
            if client.silence is not None:
                client.silence.heard()
            with best_effort(f"handling a {type(message).__name__} from {client.label}", logger, warn=True):
                if isinstance(message, RemoteOutput):
                    client.deliver(message)
                elif isinstance(message, WorkerProgress):
                    client.count_steps(message.counters)
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
            client.attach(
                identity,
                worker,
                self.send,
                heartbeat_interval_s=self.head.heartbeat_interval_s,
                heartbeat_timeout_s=self.head.heartbeat_timeout_s,
            )
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
        while True:
            await asyncio.sleep(self.head.heartbeat_interval_s)
            for client in self.clients.values():
                if client.identity is None or client.silence is None:
                    continue
                if client.silence.tick():
                    client.detach(f"sent nothing for {self.head.heartbeat_timeout_s:.0f} s")
                    continue
                with best_effort("sending a heartbeat to a headless worker", logger):
                    await self.send(client.identity, Heartbeat())

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for client in self.clients.values():
            if client.identity is not None:
                with best_effort("telling a headless worker the head shuts down", logger):
                    await asyncio.wait_for(self.send(client.identity, HeadShutdown()), 1.0)
        if self._router is not None:
            self._router.close(linger=500)
        if self._context is not None:
            self._context.term()


class HeadlessPlacement(StagePlacement):
    """Stages whose replicas a worker on another host runs: one ``RemoteStageClient`` each, served by
    one ``HeadlessStageRegistry`` that starts once the head's other stages run (starting those blocks
    the event loop at times, which a worker's heartbeats must not see)."""

    def __init__(self, deployment: ResolvedDeployment) -> None:
        self.deployment = deployment
        self.remote: dict[int, RemoteStageClient] = {}
        """The head's client of each headless stage, by stage id."""
        self.registry: HeadlessStageRegistry | None = None
        """Where the workers register, while the placement runs."""

    def place(
        self, deployment: ResolvedDeployment, stage: ResolvedStage, connectors: dict[str, OmniConnector]
    ) -> list[StageCoreClientBase]:
        ends = StageConnectors.of(deployment, stage)
        remote = RemoteStageClient(
            stage.stage_id,
            stage.name,
            input_connector=connectors.get(ends.input) if ends.input else None,
            output_connector=connectors.get(ends.output) if ends.output else None,
        )
        self.remote[stage.stage_id] = remote
        return [remote]

    async def start(self) -> None:
        if self.remote:
            registry = HeadlessStageRegistry(self.deployment, self.remote)
            await registry.start()
            self.registry = registry

    def abandon(self) -> None:
        """Nothing: the workers are told in ``shutdown``, which follows."""

    async def shutdown(self) -> None:
        """Tell the workers that the head is going (they stop their replicas and exit)."""
        if self.registry is not None:
            registry, self.registry = self.registry, None
            await registry.shutdown()

    def health(self) -> dict[str, Any]:
        """Where the workers register, and whether the head accepts them yet."""
        head = self.deployment.head
        address = tcp_address(head.host, head.port)
        return {"headless": {"address": address, "accepting": self.registry is not None}}
