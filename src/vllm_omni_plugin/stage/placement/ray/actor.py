"""``StageReplicaActor``: one stage replica as a Ray actor (backend ``ray``), the process Ray places,
watches and restarts.

The actor is the stage's process: a diffusion replica runs its engine in the actor itself (the replica's
batch loop, as a ``StageDiffusionCoreProc`` hosts it, reading and putting payloads through the edges'
connectors), an AR replica runs vLLM's ``AsyncLLM`` whose
``EngineCore`` is the actor's child. Anything fatal ends the actor's process, so that Ray restarts it
(``max_restarts``); the head learns of it from Ray, never from a heartbeat of ours.

Every call carries our msgspec structs as bytes. ``__init__`` only records what to run (Ray calls it
again on each restart); ``placed()`` says where the actor landed, ``ready()`` loads the stage there
(once per incarnation) and says when it is loaded. Payloads travel through the connectors of the
stage's edges, picked per edge from Ray's node ids: the edge's ``same_node_connector`` when this actor
shares a node with the head (the other end of every hand-over it makes), else the edge's connector.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

import msgspec

from vllm_omni_plugin.config.resolved import ResolvedEdge
from vllm_omni_plugin.config.schema import ConnectorSpec
from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_plugin.log import best_effort, get_logger
from vllm_omni_plugin.processes import ProcessTree, descendants, own_resource_tracker
from vllm_omni_plugin.stage.core_client import StageState
from vllm_omni_plugin.stage.core_types import (
    StageAbort,
    StageDiffusionCoreRequest,
    StageFailed,
    StageLLMCoreRequest,
    StageReady,
    diffusion_request_union,
)
from vllm_omni_plugin.stage.errors import StageDeadError, StageError

if TYPE_CHECKING:
    from vllm_omni_plugin.connectors.base import OmniConnector
    from vllm_omni_plugin.stage.core_client import StageCoreClientBase

logger = get_logger(__name__)
# This module stays light (no torch, no vLLM at import): a new actor answers ``placed()`` as soon as its
# process is up, which is what the start-up barrier measures; the stage's modules load in ``_load``.

LOAD_STOP_WAIT_S = 15.0
"""How long a stop waits for a load under way to end, once the processes it started are gone."""
CHILD_EXIT_GRACE_S = 5.0
"""How long the processes of a load that is stopped get to exit on SIGTERM before SIGKILL."""
EXIT_STAGE_DIED = 70
"""Exit status of an actor whose stage died (its vLLM engine core): Ray restarts it."""


class ReplicaSpec(msgspec.Struct, kw_only=True):
    """What one actor runs: the resolved stage's arguments for one replica, and its edges' connectors."""

    stage_id: int
    replica_id: int
    name: str
    execution_type: str
    head_node_id: str
    """The Ray node of the head (API server), the other end of this replica's hand-overs."""
    engine_args: dict[str, Any] = {}
    default_sampling_params: dict[str, Any] = {}
    diffusion_args: dict[str, Any] = {}
    env: dict[str, str] = {}
    input_edge: ResolvedEdge | None = None
    """The edge the stage's request tensors arrive through (None: they travel inside the message)."""
    output_edge: ResolvedEdge | None = None
    """The edge the final stage's output goes back through (None: inside the message)."""
    connectors: dict[str, ConnectorSpec] = {}
    """The deploy-config connectors those edges may use, by name."""


class ActorPlaced(msgspec.Struct, kw_only=True):
    """Where Ray runs the actor."""

    node_id: str
    node_ip: str
    host: str
    pid: int


class ActorStats(msgspec.Struct, kw_only=True):
    served: int
    """Requests this incarnation of the actor answered."""
    input_connector: str | None
    output_connector: str | None


class StageReplicaActor:
    """Wrapped with ``ray.remote`` by the head (this module imports no Ray at module level)."""

    def __init__(self, spec: bytes) -> None:
        import ray

        self.spec = msgspec.msgpack.decode(spec, type=ReplicaSpec)
        os.environ.update(self.spec.env)  # before anything of the stage is imported or loaded
        context = ray.get_runtime_context()
        self.where = ActorPlaced(
            node_id=context.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        same_node = self.where.node_id == self.spec.head_node_id
        self.input_name = self.spec.input_edge.connector_between(same_node) if self.spec.input_edge else None
        self.output_name = (
            self.spec.output_edge.connector_between(same_node) if self.spec.output_edge else None
        )
        self.input_connector: OmniConnector | None = None
        self.output_connector: OmniConnector | None = None
        self.replica: StageCoreClientBase | None = None
        self._starting: StageCoreClientBase | None = None
        """The replica ``_load`` builds, until it is loaded (a stop meanwhile must reach what it made)."""
        self.served = 0
        self._loading: asyncio.Task[StageReady | StageFailed] | None = None
        self._stopped: asyncio.Event | None = None
        self._requests: dict[str, asyncio.Task[Any]] = {}
        self._codecs: tuple[Any, Any] | None = None
        """(request decoder, reply encoder), made by the first request (they import torch)."""

    @property
    def label(self) -> str:
        return f"stage {self.spec.stage_id} ({self.spec.name}) replica {self.spec.replica_id}"

    # --- life -----------------------------------------------------------------------------------

    async def placed(self) -> bytes:
        """Where this actor runs (nothing is loaded yet: the head first waits for every placement)."""
        return msgspec.msgpack.encode(self.where)

    async def ready(self) -> bytes:
        """Load the stage (the first call of this incarnation starts it); ``StageReady`` once loaded, or
        ``StageFailed`` with the one-line reason."""
        if self._loading is None:
            self._loading = asyncio.create_task(self._load(), name=f"{self.label} load")
        return msgspec.msgpack.encode(await asyncio.shield(self._loading))

    async def _load(self) -> StageReady | StageFailed:
        start = time.perf_counter()
        try:
            replica, device = self._replica()
            self._starting = replica
            await replica.start()
        except Exception as exc:  # reported to the head as one line; the detail goes to the log
            if self._starting is not None and self._starting.state == StageState.STOPPED:
                logger.info("%s: stopped while it loaded", self.label)
            else:
                logger.exception("%s failed to load on %s", self.label, self.where.host)
            return StageFailed(error=f"{type(exc).__name__}: {exc}".splitlines()[0])
        self.replica = replica
        seconds = time.perf_counter() - start
        logger.info("%s loaded on %s (pid %d) in %.1fs", self.label, self.where.host, self.where.pid, seconds)
        return StageReady(
            pid=self.where.pid,
            load_seconds=seconds,
            weight_bytes=replica.weight_bytes,
            device=f"{device} on {self.where.host}",
        )

    def _replica(self) -> tuple[StageCoreClientBase, str]:
        """The stage's client in this actor, and what it runs (a model directory this host lacks is named
        with the host)."""
        spec = self.spec
        ar = spec.execution_type == "llm_ar"
        args = spec.engine_args if ar else spec.diffusion_args
        model = args.get("model")
        if model and not os.path.isdir(model):
            raise FileNotFoundError(f"model directory {model} does not exist on {self.where.host}")
        if ar:
            from vllm_omni_plugin.stage.llm_core_client import StageLLMCoreClient

            # Ray restarts the actor instead: a dead engine core ends this process (see generate).
            engine = StageLLMCoreClient(
                spec.stage_id,
                spec.replica_id,
                args,
                name=spec.name,
                restart=False,
                default_sampling_params=spec.default_sampling_params,
            )
            return engine, "vLLM engine"
        from vllm_omni_plugin.stage.diffusion_core_client import InlineStageDiffusionClient

        self.input_connector = self._connector(self.input_name)
        self.output_connector = self._connector(self.output_name)
        client = InlineStageDiffusionClient(
            spec.stage_id,
            spec.replica_id,
            args,
            name=spec.name,
            input_connector=self.input_connector,
            output_connector=self.output_connector,
        )
        return client, "diffusion engine"

    def _connector(self, name: str | None) -> OmniConnector | None:
        from vllm_omni_plugin.connectors.base import make_connector

        if name is None:
            return None
        connector = self.spec.connectors[name]
        return make_connector(name, connector.name, dict(connector.extra))

    async def watch(self) -> None:
        """Returns only when the actor is shut down; the head keeps one call pending and learns from Ray
        that the actor died when it fails."""
        if self._stopped is None:
            self._stopped = asyncio.Event()
        await self._stopped.wait()

    async def shutdown(self) -> None:
        """Stop the stage and release what it holds (the head then kills the actor)."""
        for task in list(self._requests.values()):
            task.cancel()
        if self._loading is not None and not self._loading.done():
            await self._stop_loading()
        if self.replica is not None:
            with best_effort("shutting down the actor's stage replica", logger, warn=True):
                await self.replica.shutdown()
        for connector in (self.input_connector, self.output_connector):
            if connector is not None:
                with best_effort("closing a connector of the actor", logger, warn=True):
                    connector.close()
        if self._stopped is None:
            self._stopped = asyncio.Event()
        self._stopped.set()

    async def _stop_loading(self) -> None:
        """A stop while the stage loads (start-up abandoned): its engine is built in a thread that no
        cancel reaches, so mark the replica stopped (what the build made is then shut down, its
        processes and shared memory with it) and wait for the load to end."""
        assert self._loading is not None
        if self._starting is not None:
            with best_effort("stopping the stage replica that loads", logger, warn=True):
                await self._starting.shutdown()
        # The engine's processes are this actor's only children: ending them ends the build at once (a
        # build that waits for them fails), where it might otherwise load for minutes yet.
        children = ProcessTree(self.label)
        tracker = own_resource_tracker()  # the actor's, not the engine's: it unlinks what it tracks
        for pid in descendants(os.getpid()):
            if pid != tracker:
                children.record(pid)
        for member in children.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(member.pid, signal.SIGTERM)
        await asyncio.to_thread(children.stop, CHILD_EXIT_GRACE_S)
        with best_effort("waiting for the stage's load to end", logger, warn=True):
            await asyncio.wait_for(asyncio.shield(self._loading), LOAD_STOP_WAIT_S)

    # --- requests -------------------------------------------------------------------------------

    async def generate(self, data: bytes) -> bytes:
        from vllm_omni_plugin.stage.placement.wire import RemoteOutput, error_kind
        from vllm_omni_plugin.stage.serialization import StageMessageCodec

        if self._codecs is None:
            self._codecs = (
                StageMessageCodec(StageLLMCoreRequest | StageDiffusionCoreRequest[diffusion_request_union()]),
                StageMessageCodec(RemoteOutput),
            )
        requests, codec = self._codecs
        request = requests.decode(data)
        reply = RemoteOutput(request_id=request.request_id)
        if self.replica is None:
            reply.error, reply.error_kind = f"{self.label} is not loaded", "dead"
            return codec.encode(reply)
        task = asyncio.current_task()
        assert task is not None
        self._requests[request.request_id] = task
        try:
            reply.output = await self.replica.generate(request)
            self.served += 1
        except StageDeadError:
            # The stage's engine died in this process: end the process, Ray restarts the actor and
            # the head fails (or retries) this request as for any replica that died.
            logger.error("%s: the stage died; exiting so that Ray restarts this actor", self.label)
            os._exit(EXIT_STAGE_DIED)
        except StageError as exc:
            reply.error, reply.error_kind = str(exc), error_kind(exc)
        except Exception as exc:  # this request's failure, reported to the head
            logger.exception("%s: request %s failed", self.label, request.request_id)
            reply.error, reply.error_kind = f"{type(exc).__name__}: {exc}", "stage"
        finally:
            self._requests.pop(request.request_id, None)
        return codec.encode(reply)

    async def abort(self, data: bytes) -> None:
        message = msgspec.msgpack.decode(data, type=StageAbort)
        if self.replica is not None:
            await self.replica.abort(list(message.request_ids))
        for request_id in message.request_ids:
            task = self._requests.pop(request_id, None)
            if task is not None:
                task.cancel()

    # --- stats ----------------------------------------------------------------------------------

    async def stats(self) -> bytes:
        return msgspec.msgpack.encode(
            ActorStats(served=self.served, input_connector=self.input_name, output_connector=self.output_name)
        )

    async def diffusion_counters(self) -> bytes:
        """This incarnation's running diffusion counts, msgpack-encoded (the head asks while it serves)."""
        counters = self.replica.diffusion if self.replica is not None else DiffusionCounters()
        return msgspec.msgpack.encode(counters)

    async def log_stats(self) -> None:
        if self.replica is not None:
            await self.replica.log_stats()
