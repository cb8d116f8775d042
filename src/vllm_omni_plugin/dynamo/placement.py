"""Stages whose replicas are Dynamo stage workers: the router role's placement.

Each stage gets one ``DynamoStageClient`` in its replica pool, standing for every worker that serves the
stage's endpoint (``dyn://NAMESPACE.COMPONENT-stageN.ENDPOINT``), however many there are and as they
come and go; the orchestrator treats it like any replica.

* Discovery: the client watches the endpoint's instances (Dynamo's discovery: etcd, Kubernetes, a
  folder). A new instance is asked what it serves (``StageInfo``); one whose stage config digest differs
  from the router's (another deploy file) is refused, once, in the log. Until some worker is ready,
  requests for the stage wait (``awaits_worker``), as for a headless stage.
* Routing: each request goes to the ready worker with the fewest requests in flight (then the one that
  was given the fewest, so a worker that joins is used at once), by ``Client.direct``.
* Loss: a worker whose reply stream breaks (it died: Dynamo ends the stream at once) fails that
  request with ``StageDeadError``, which the orchestrator runs again on another worker within the
  request's ``max_retries``, as on the local backend; the worker is left out until discovery drops it
  (its lease runs out, about 10 s) or it answers again.
* Aborts: a request the orchestrator aborts is stopped through its Dynamo context, and its worker drops it.
* Payloads go through the deployment's connectors (this process's objects put the stage's inputs and
  collect its images; the workers' replica processes build their own), so only handles cross Dynamo.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_plugin.config.resolved import ResolvedDeployment, ResolvedStage
from vllm_omni_plugin.connectors.base import OmniConnector
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
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.core_client import StageCoreClientBase, StageState
from vllm_omni_plugin.stage.core_types import PROGRESS_REPORT_INTERVAL_S
from vllm_omni_plugin.stage.errors import RequestAbortedError, StageDeadError, StageError
from vllm_omni_plugin.stage.payload import discard_output, released_if_replica_dies, send_request_through
from vllm_omni_plugin.stage.placement.base import StageConnectors, StagePlacement
from vllm_omni_plugin.stage.placement.wire import RemoteOutput, remote_stage_output, stage_config_digest

logger = get_logger(__name__)

WATCH_S = 0.2
"""How often the client reads the endpoint's instances from discovery."""
PROBE_TIMEOUT_S = 10.0
"""How long a new (or lost) worker may take to say what it serves."""
PROBE_RETRY_S = 1.0
STATS_AFTER_S = 2.0
"""How long after its last request a worker's counts are still asked for (a drop it reports late)."""


@dataclass
class StageWorker:
    """One Dynamo instance of a stage's endpoint, as the router knows it."""

    instance_id: int
    info: StageInfo | None = None
    """What it said it serves; None until it answered (and while it is not trusted)."""
    refused: str | None = None
    """Why the router does not use it (another deploy config)."""
    lost: bool = False
    """A request's stream to it broke: left out until it answers again or leaves discovery."""
    inflight: set[str] = field(default_factory=set)
    sent: int = 0
    stats: StageStats = field(default_factory=StageStats)
    next_probe: float = 0.0
    probing: bool = False
    counting_until: float = 0.0
    """Its counts are asked for while it works and for ``STATS_AFTER_S`` after (not while idle)."""
    polling: bool = False

    @property
    def ready(self) -> bool:
        return self.info is not None and not self.lost and self.refused is None

    @property
    def label(self) -> str:
        where = f"{self.info.host} pid {self.info.pid}" if self.info is not None else "not yet known"
        return f"worker {self.instance_id:x} ({where})"


class DynamoStageClient(StageCoreClientBase):
    """The router's view of one stage: every Dynamo stage worker discovery finds for it."""

    def __init__(
        self,
        stage: ResolvedStage,
        *,
        runtime: Any,
        path: str,
        digest: str,
        input_connector: OmniConnector | None = None,
        output_connector: OmniConnector | None = None,
    ) -> None:
        super().__init__(stage.stage_id, 0, stage.name, restart=False)
        self.runtime = runtime
        self.path = path
        self.digest = digest
        self.input_connector = input_connector
        self.output_connector = output_connector
        self.workers: dict[int, StageWorker] = {}
        self.joins = 0
        self._client: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._contexts: dict[str, Any] = {}
        self._aborted: set[str] = set()
        self._gone = StageStats()
        """What workers that left counted (kept, so the metrics only rise)."""
        self._codec_out = DynamoCodec(ToStage)
        self._codec_in = DynamoCodec(FromStage)

    @property
    def label(self) -> str:
        return f"stage {self.stage_id} ({self.name}) on dyn://{self.path}"

    @property
    def awaits_worker(self) -> bool:
        return self.state in (StageState.STARTING, StageState.RESTARTING)

    def health(self) -> dict[str, Any]:
        workers = [
            {
                "instance": f"{w.instance_id:x}",
                "host": w.info.host if w.info else None,
                "pid": w.info.pid if w.info else None,
                "ready": w.ready,
                "inflight": len(w.inflight),
                **({"refused": w.refused} if w.refused else {}),
            }
            for w in self.workers.values()
        ]
        return {**super().health(), "endpoint": f"dyn://{self.path}", "workers": workers}

    async def start(self) -> None:
        """Watch the endpoint; workers come to it (requests wait for one meanwhile)."""
        self._client = await self.runtime.endpoint(self.path).client()
        self._spawn(self._watch(), f"dynamo discovery of stage {self.stage_id}")

    def _spawn(self, work: Any, name: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self) -> None:
        last_stats = 0.0
        while self.state != StageState.STOPPED:
            now = time.monotonic()
            present = set(self._client.instance_ids())
            for instance_id in present - set(self.workers):
                self.workers[instance_id] = StageWorker(instance_id)
            for instance_id in set(self.workers) - present:
                self._left(self.workers.pop(instance_id))
            for worker in self.workers.values():
                if (
                    not worker.ready
                    and worker.refused is None
                    and not worker.probing
                    and now >= worker.next_probe
                ):
                    worker.probing = True
                    self._spawn(self._probe(worker), f"probe of {worker.label}")
            if now - last_stats >= PROGRESS_REPORT_INTERVAL_S:
                last_stats = now
                for worker in self.workers.values():
                    busy = worker.inflight or now < worker.counting_until
                    if worker.ready and busy and not worker.polling:
                        worker.polling = True
                        self._spawn(self._poll_stats(worker), f"stats of {worker.label}")
            self._update_state()
            await asyncio.sleep(WATCH_S)

    async def _probe(self, worker: StageWorker) -> None:
        """Ask a new (or lost) worker what it serves; ready once it answers for our stage and config."""
        try:
            reply = await asyncio.wait_for(self._ask(worker, StageInfoRequest()), PROBE_TIMEOUT_S)
        except Exception as exc:  # not up yet, or gone: asked again later
            logger.debug("%s: %s did not answer (%s)", self.label, worker.label, exc)
            reply = None
        finally:
            worker.probing = False
            worker.next_probe = time.monotonic() + PROBE_RETRY_S
        if not isinstance(reply, StageInfo) or worker.instance_id not in self.workers:
            return
        if reply.stage_id != self.stage_id or reply.config_digest != self.digest:
            worker.info = reply
            worker.refused = (
                f"it serves stage {reply.stage_id} of another deploy config (digest {reply.config_digest}, "
                f"the router's {self.digest}); start the router and its workers with the same file"
            )
            logger.warning("%s: refused %s: %s", self.label, worker.label, worker.refused)
            return
        rejoined = worker.lost
        worker.info, worker.lost = reply, False
        worker.counting_until = time.monotonic() + STATS_AFTER_S  # its counts so far
        if not rejoined:
            self.joins += 1
            self.restarts = max(0, self.joins - 1)
        logger.info(
            "%s: %s %s (%d replica(s))", self.label, worker.label, "answers again" if rejoined else "joined",
            reply.replicas,
        )  # fmt: skip
        self._update_state()

    async def _poll_stats(self, worker: StageWorker) -> None:
        try:
            reply = await asyncio.wait_for(self._ask(worker, StageStatsRequest()), PROBE_TIMEOUT_S)
        except Exception:  # a worker that is going: its last counts stay
            return
        finally:
            worker.polling = False
        if isinstance(reply, StageStats) and worker.instance_id in self.workers:
            worker.stats = reply
            self._count()

    def _left(self, worker: StageWorker) -> None:
        """Discovery dropped the worker (it stopped, or its lease ran out after it died)."""
        self._gone = _plus(self._gone, worker.stats)
        self._count()
        if worker.info is not None and worker.refused is None:
            logger.info("%s: %s left", self.label, worker.label)
        self._update_state()

    def _count(self) -> None:
        total = self._gone
        for worker in self.workers.values():
            total = _plus(total, worker.stats)
        self.diffusion = total.counters
        self.dropped = collections.Counter(total.dropped)

    def _update_state(self) -> None:
        if self.state == StageState.STOPPED:
            return
        if any(w.ready for w in self.workers.values()):
            self.state = StageState.READY
        elif self.state == StageState.READY:
            logger.warning("%s: no worker is ready; its requests wait for one", self.label)
            self.state = StageState.RESTARTING

    def _pick(self) -> StageWorker:
        ready = [w for w in self.workers.values() if w.ready]
        if not ready:
            raise StageDeadError(f"{self.label} has no ready worker", stage_id=self.stage_id, where="unsent")
        return min(ready, key=lambda w: (len(w.inflight), w.sent, w.instance_id))

    async def _ask(self, worker: StageWorker, message: Any, context: Any = None) -> Any:
        """Send one message to one worker; its one reply (None: the stream ended without one)."""
        stream = await self._client.direct(self._codec_out.pack(message), worker.instance_id, context=context)
        reply = None
        async for item in stream:
            reply = self._codec_in.unpack(item.data())
        return reply

    def _lost(self, worker: StageWorker, cause: str) -> StageDeadError:
        """A request's stream to ``worker`` broke: the worker is taken for dead until it answers again."""
        if not worker.lost:
            worker.lost = True
            self.deaths += 1
            logger.error(
                "%s: %s was lost (%s) with %d request(s) in flight; they run again on another worker",
                self.label, worker.label, cause, len(worker.inflight),
            )  # fmt: skip
            self._update_state()
        return StageDeadError(
            f"{self.label}: {worker.label} was lost ({cause}) while serving this request",
            stage_id=self.stage_id,
        )

    async def generate(self, request: Any) -> Any:
        from dynamo.runtime import Context

        worker = self._pick()
        request, put_seconds = send_request_through(request, self.input_connector)
        request_id = request.request_id
        context = Context()
        self._contexts[request_id] = context
        self.inflight.add(request_id)
        worker.inflight.add(request_id)
        worker.sent += 1
        try:
            with released_if_replica_dies(request, self.input_connector):
                try:
                    reply = await self._ask(worker, StageCall(request=request), context)
                except asyncio.CancelledError:
                    context.stop_generating()  # the worker drops it (cancelling alone would not tell it)
                    raise
                except Exception as exc:  # Dynamo's transport: the stream broke
                    if request_id in self._aborted:
                        raise RequestAbortedError(
                            "aborted", stage_id=self.stage_id, request_id=request_id
                        ) from None
                    raise self._lost(worker, f"{type(exc).__name__}: {exc}") from None
                if request_id in self._aborted:
                    if isinstance(reply, RemoteOutput):
                        discard_output(reply.output, self.output_connector)
                        self.discarded_outputs += 1
                    raise RequestAbortedError("aborted", stage_id=self.stage_id, request_id=request_id)
                if reply is None:
                    raise self._lost(worker, "its reply stream ended without a reply")
        finally:
            self._contexts.pop(request_id, None)
            self._aborted.discard(request_id)
            self.inflight.discard(request_id)
            worker.inflight.discard(request_id)
            worker.counting_until = time.monotonic() + STATS_AFTER_S
        if not isinstance(reply, RemoteOutput):
            raise StageError(f"{self.label}: {worker.label} answered a request with {type(reply).__name__}")
        return remote_stage_output(reply, f"{self.label} {worker.label}", self.stage_id, put_seconds,
                                   self.output_connector)  # fmt: skip

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            context = self._contexts.get(request_id)
            if context is not None:
                self._aborted.add(request_id)
                context.stop_generating()

    async def shutdown(self) -> None:
        self.state = StageState.STOPPED
        for context in list(self._contexts.values()):
            context.stop_generating()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _plus(a: StageStats, b: StageStats) -> StageStats:
    dropped = collections.Counter(a.dropped)
    dropped.update(b.dropped)
    return StageStats(
        counters=a.counters.plus(b.counters),
        dropped=dict(dropped),
        discarded_outputs=a.discarded_outputs + b.discarded_outputs,
        deaths=a.deaths + b.deaths,
    )


class DynamoPlacement(StagePlacement):
    """Every stage of the deployment on Dynamo stage workers (``stage_path(stage_id)``: their endpoint)."""

    def __init__(
        self, deployment: ResolvedDeployment, runtime: Any, stage_path: Callable[[int], str]
    ) -> None:
        self.deployment = deployment
        self.runtime = runtime
        self.stage_path = stage_path
        self.clients: dict[int, DynamoStageClient] = {}

    def place(
        self, deployment: ResolvedDeployment, stage: ResolvedStage, connectors: dict[str, OmniConnector]
    ) -> list[StageCoreClientBase]:
        ends = StageConnectors.of(deployment, stage)
        client = DynamoStageClient(
            stage,
            runtime=self.runtime,
            path=self.stage_path(stage.stage_id),
            digest=stage_config_digest(deployment, stage.stage_id),
            input_connector=connectors.get(ends.input) if ends.input else None,
            output_connector=connectors.get(ends.output) if ends.output else None,
        )
        self.clients[stage.stage_id] = client
        return [client]

    async def start(self) -> None:
        """Nothing beyond the clients, which watch discovery from their start."""

    def abandon(self) -> None:
        """Nothing: the workers are not ours to stop."""

    async def shutdown(self) -> None:
        """Nothing beyond the clients, which their pools shut down (the workers stay for the next router)."""

    def health(self) -> dict[str, Any]:
        return {
            "dynamo": {
                str(sid): {"endpoint": f"dyn://{c.path}", "workers": sum(w.ready for w in c.workers.values())}
                for sid, c in self.clients.items()
            }
        }
