"""A Dynamo stage worker: one stage's replicas on this host (a ``StageReplicaPool`` on ``LocalPlacement``,
as a headless worker runs them), served as a Dynamo endpoint that routers find through discovery.

Started with ``python -m vllm_omni_plugin.dynamo MODEL --deploy-config F --stage-id N``; the role module
(``roles.py``) owns the runtime and the endpoint, this class answers its requests: what the stage is
(``StageInfo``, with its config digest), its running counts (``StageStats``) and stage requests (``StageCall``
-> ``RemoteOutput``). When the router stops a request through Dynamo (an abort, a client gone), its replica
drops it. Payloads do not pass through this process: the replica processes build the stage's connectors, and
messages carry handles.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

from vllm_omni_plugin.config.resolved import ResolvedDeployment
from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_plugin.dynamo.stage_wire import (
    DynamoCodec,
    FromStage,
    StageCall,
    StageInfo,
    StageInfoRequest,
    StageStats,
    StageStatsRequest,
    ToStage,
)
from vllm_omni_plugin.log import best_effort, get_logger
from vllm_omni_plugin.stage.errors import StageError
from vllm_omni_plugin.stage.factory import build_stages
from vllm_omni_plugin.stage.placement.local.placement import LocalPlacement
from vllm_omni_plugin.stage.placement.wire import RemoteOutput, error_kind, stage_config_digest
from vllm_omni_plugin.stage.replica_pool import StageReplicaPool

logger = get_logger(__name__)


class DynamoStageWorker:
    """Serves one stage's replicas of this host to Dynamo routers."""

    def __init__(self, deployment: ResolvedDeployment, stage_id: int) -> None:
        self.deployment = deployment
        self.stage_id = stage_id
        self.worker_id = uuid.uuid4().hex[:12]
        self.pool: StageReplicaPool | None = None
        self.calls = 0
        self._codec_in = DynamoCodec(ToStage)
        self._codec_out = DynamoCodec(FromStage)

    async def start(self) -> None:
        """Load the stage's replicas (this blocks until they can take requests)."""
        # No connectors in this process: the replica processes build them and messages pass through.
        pools = build_stages(self.deployment, {}, [self.stage_id], placement=LocalPlacement())
        self.pool = pools[self.stage_id]
        await self.pool.start()
        stage = next(s for s in self.deployment.stages if s.stage_id == self.stage_id)
        logger.info(
            "stage %d (%s) loaded with %d replica(s)", self.stage_id, stage.name, len(self.pool.clients)
        )

    def stop_restarting(self) -> None:
        """A replica that dies from now on stays down (the worker is stopping)."""
        if self.pool is not None:
            self.pool.stop_restarting()

    async def shutdown(self) -> None:
        if self.pool is not None:
            await self.pool.shutdown()

    def info(self) -> StageInfo:
        assert self.pool is not None
        return StageInfo(
            stage_id=self.stage_id,
            worker_id=self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            config_digest=stage_config_digest(self.deployment, self.stage_id),
            replicas=len(self.pool.clients),
        )

    def stats(self) -> StageStats:
        assert self.pool is not None
        clients = self.pool.clients
        dropped: collections.Counter[str] = collections.Counter()
        for client in clients:
            dropped.update(client.dropped)
        return StageStats(
            counters=DiffusionCounters.total(c.diffusion for c in clients),
            dropped=dict(dropped),
            discarded_outputs=sum(c.discarded_outputs for c in clients),
            deaths=sum(c.deaths for c in clients),
            calls=self.calls,
        )

    async def generate(self, request: Any, context: Any) -> AsyncIterator[dict[str, str]]:
        """The endpoint's handler (Dynamo passes its second argument by the name ``context``)."""
        try:
            message = self._codec_in.unpack(request)
        except ValueError as exc:
            logger.warning("refused a request on stage %d's endpoint: %s", self.stage_id, exc)
            yield self._codec_out.pack(RemoteOutput(request_id="", error=str(exc), error_kind="request"))
            return
        if isinstance(message, StageInfoRequest):
            yield self._codec_out.pack(self.info())
        elif isinstance(message, StageStatsRequest):
            yield self._codec_out.pack(self.stats())
        elif isinstance(message, StageCall):
            reply = await self._run(message, context)
            if reply is not None:
                yield self._codec_out.pack(reply)

    async def _run(self, call: StageCall, context: Any) -> RemoteOutput | None:
        """The request's output (or the error its stage raised); None when the router stopped it, which
        its replica then drops."""
        assert self.pool is not None
        request = call.request
        self.calls += 1
        task = asyncio.ensure_future(self.pool.generate(request))
        stopped = asyncio.ensure_future(context.async_killed_or_stopped())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not task.done():  # stopped by the router, or this handler was cancelled
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                with best_effort("aborting a stopped request in the stage's replicas", logger):
                    await self.pool.abort([request.request_id])
        if task.cancelled():
            return None
        reply = RemoteOutput(request_id=request.request_id)
        try:
            reply.output = task.result()
        except StageError as exc:
            reply.error, reply.error_kind = str(exc), error_kind(exc)
        except Exception as exc:  # reported to the router as this request's failure
            logger.exception("request %s failed on this worker", request.request_id)
            reply.error, reply.error_kind = f"{type(exc).__name__}: {exc}", "stage"
        return reply
