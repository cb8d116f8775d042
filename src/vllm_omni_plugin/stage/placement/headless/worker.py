"""A headless stage worker: runs one stage's replicas on this host and serves them to a head.

Started with ``vllm serve MODEL --omni --deploy-config F --stage-id N --headless --head ADDR:PORT``. It
loads the stage (a ``StageReplicaPool`` of its own, on this host's ``LocalPlacement``), registers with the
head's ``HeadlessStageRegistry``, answers its requests and heartbeats, and exits when the head goes away
or a signal stops it (telling the head, which then fails the worker's requests at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import uuid
from typing import Any

from vllm_omni_plugin.config.resolved import ResolvedDeployment
from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_plugin.log import best_effort, get_logger
from vllm_omni_plugin.stage.core_types import (
    PROGRESS_REPORT_INTERVAL_S,
    StageAbort,
    StageDiffusionCoreRequest,
    StageLLMCoreRequest,
)
from vllm_omni_plugin.stage.errors import StageError
from vllm_omni_plugin.stage.factory import build_stages
from vllm_omni_plugin.stage.placement.headless import protocol
from vllm_omni_plugin.stage.placement.local.placement import LocalPlacement
from vllm_omni_plugin.stage.placement.wire import RemoteOutput, error_kind
from vllm_omni_plugin.stage.replica_pool import StageReplicaPool
from vllm_omni_plugin.stage.serialization import StageMessageCodec

logger = get_logger(__name__)

REGISTER_RETRY_S = 2.0
WAITING_LOG_S = 30.0


class HeadlessStageWorker:
    """Runs one stage's replicas here and serves them to a head; ``run()`` returns the exit code."""

    def __init__(self, deployment: ResolvedDeployment, stage_id: int, head_address: str) -> None:
        self.deployment = deployment
        self.stage_id = stage_id
        self.head_host, self.head_port = protocol.parse_head_address(head_address)
        self.head_url = protocol.tcp_address(self.head_host, self.head_port)
        self.worker_id = uuid.uuid4().hex[:12]
        self._codec_out = StageMessageCodec(protocol.WorkerMessage)
        self._codec_in = StageMessageCodec(protocol.HeadMessage)
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._dealer: Any = None
        self._stopping: asyncio.Future[tuple[int, str]] | None = None
        self._leaving = False
        """Stopped by a signal: tell the head we go, so it fails our requests at once."""

    async def run(self) -> int:
        import zmq
        import zmq.asyncio

        loop = asyncio.get_running_loop()
        self._stopping = loop.create_future()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        stage = next(s for s in self.deployment.stages if s.stage_id == self.stage_id)
        # No connectors in this process: the replica processes build them and messages pass through.
        pools = build_stages(self.deployment, {}, [self.stage_id], placement=LocalPlacement())
        pool = pools[self.stage_id]
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
            accepted = await self._register(pool)
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
                with best_effort("telling the head this worker leaves", logger):
                    await asyncio.wait_for(self._send(protocol.WorkerLeaving(reason=why)), 1.0)
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

    async def _register(self, pool: StageReplicaPool) -> protocol.WorkerAccepted | None:
        assert self._stopping is not None
        register = protocol.WorkerRegister(
            stage_id=self.stage_id,
            worker_id=self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            config_digest=protocol.stage_config_digest(self.deployment, self.stage_id),
        )
        waited = 0.0
        while not self._stopping.done():
            await self._send(register)
            if await self._dealer.poll(REGISTER_RETRY_S * 1000):
                message = self._codec_in.decode(await self._dealer.recv())
                if isinstance(message, protocol.WorkerAccepted):
                    return message
                if isinstance(message, protocol.WorkerRejected):
                    self._stop(1, f"the head at {self.head_url} refused this worker: {message.reason}")
                    return None
                continue
            waited += REGISTER_RETRY_S
            if waited % WAITING_LOG_S < REGISTER_RETRY_S:
                logger.info("still waiting for the head at %s (%.0f s)", self.head_url, waited)
        return None

    async def _serve(self, pool: StageReplicaPool, accepted: protocol.WorkerAccepted) -> None:
        silence = protocol.PeerSilence(accepted.heartbeat_interval_s, accepted.heartbeat_timeout_s)

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(accepted.heartbeat_interval_s)
                if silence.tick():
                    self._stop(
                        1,
                        f"the head at {self.head_url} sent nothing for {accepted.heartbeat_timeout_s:.0f} s",
                    )
                    return
                await self._send(protocol.Heartbeat())

        async def progress() -> None:
            """The replicas' diffusion counts, for the head's /metrics, whenever they changed."""
            sent = DiffusionCounters()
            while True:
                await asyncio.sleep(PROGRESS_REPORT_INTERVAL_S)
                counters = DiffusionCounters.total(r.diffusion for r in pool.clients)
                if counters != sent:
                    await self._send(protocol.WorkerProgress(counters=counters))
                    sent = counters

        beat = asyncio.create_task(heartbeat(), name="heartbeat to head")
        steps = asyncio.create_task(progress(), name="progress to head")
        try:
            while True:
                message = self._codec_in.decode(await self._dealer.recv())
                silence.heard()
                if isinstance(message, protocol.RemoteRequest):
                    request = message.request
                    self._tasks[request.request_id] = asyncio.create_task(self._generate(pool, request))
                elif isinstance(message, StageAbort):
                    for request_id in message.request_ids:
                        task = self._tasks.pop(request_id, None)
                        if task is not None:
                            task.cancel()
                    await pool.abort(list(message.request_ids))
                elif isinstance(message, protocol.HeadShutdown):
                    self._stop(0, "the head shut down")
                    return
                elif isinstance(message, protocol.WorkerRejected):  # the head restarted and forgot us
                    self._stop(
                        1, f"the head at {self.head_url} no longer knows this worker ({message.reason})"
                    )
                    return
        finally:
            beat.cancel()
            steps.cancel()

    async def _generate(
        self, pool: StageReplicaPool, request: StageLLMCoreRequest | StageDiffusionCoreRequest
    ) -> None:
        reply = RemoteOutput(request_id=request.request_id)
        try:
            reply.output = await pool.generate(request)
        except asyncio.CancelledError:
            return
        except StageError as exc:
            reply.error, reply.error_kind = str(exc), error_kind(exc)
        except Exception as exc:  # reported to the head as this request's failure
            logger.exception("request %s failed on this worker", request.request_id)
            reply.error, reply.error_kind = f"{type(exc).__name__}: {exc}", "stage"
        finally:
            self._tasks.pop(request.request_id, None)
        await self._send(reply)


def run_headless_worker(deployment: ResolvedDeployment, stage_id: int, head_address: str) -> int:
    return asyncio.run(HeadlessStageWorker(deployment, stage_id, head_address).run())
