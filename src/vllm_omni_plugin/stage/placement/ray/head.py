"""Backend ``ray``: every stage replica is a Ray actor that Ray places, restarts and discovers.

``RayPlacement`` is the stage factory's placement for a deployment whose ``backend`` is ``ray``. It
connects this process (the head: API server and orchestrator) to the running Ray cluster as a driver,
and gives each replica a ``RayStageClient`` whose actor (``actor.StageReplicaActor``) Ray places
by the stage's ``num_cpus``, ``num_gpus``, custom ``resources`` and ``node_labels``; a replica with
more than one device reserves them on one node in a placement group.

* Start-up: every actor of the deployment is created at once; nothing loads until every one of them
  has a place, and a replica that gets none within ``ray.placement_timeout_s`` fails start-up with one
  line naming its stage and what it asked for (``StagePlacementError`` when no node of the cluster has
  it). Then each actor loads its stage on its node.
* Liveness: the client keeps one ``watch()`` call pending on its actor; Ray fails it when the actor
  dies (a crash, a killed process, a lost node). In-flight requests fail with ``StageDeadError`` as on
  the local backend, and the client waits for Ray's restart (``max_restarts``), reporting in
  ``/health`` why it waits (e.g. no alive node has the resources), then reloads the stage there.
* Payloads: per edge, the edge's ``same_node_connector`` when the actor runs on the head's node, else
  the edge's own connector (NIXL between hosts).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import uuid
from typing import Any

import msgspec

from vllm_omni_plugin.config.resolved import ROUTER, RayResources, ResolvedDeployment, ResolvedStage
from vllm_omni_plugin.connectors.base import OmniConnector
from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_plugin.log import best_effort, get_logger
from vllm_omni_plugin.stage.core_client import StageCoreClientBase, StageState
from vllm_omni_plugin.stage.core_types import PROGRESS_REPORT_INTERVAL_S, StageAbort, StageFailed, StageReady
from vllm_omni_plugin.stage.errors import (
    RequestAbortedError,
    StageDeadError,
    StageError,
    StagePlacementError,
    StageStartError,
)
from vllm_omni_plugin.stage.payload import discard_output, released_if_replica_dies, send_request_through
from vllm_omni_plugin.stage.placement.base import StagePlacement
from vllm_omni_plugin.stage.placement.ray.actor import ActorPlaced, ReplicaSpec, StageReplicaActor
from vllm_omni_plugin.stage.placement.wire import RemoteOutput, remote_stage_output
from vllm_omni_plugin.stage.serialization import StageMessageCodec

logger = get_logger(__name__)

RECOVER_POLL_S = 0.5
"""While Ray restarts an actor: how often the client asks whether it is back."""
SHUTDOWN_WAIT_S = 10.0
ABANDON_STOP_WAIT_S = 25.0
"""How long a failed start-up waits for its actors to stop (an actor that loads ends its engine's
processes first) before it kills them."""
CONNECT_TIMEOUT_S = 10.0
"""How long the head tries to reach the cluster's address before it says nothing answers there (Ray
itself retries for minutes)."""
RAY_EXTRA = "pip install 'vllm-omni-plugin[ray]'"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise StagePlacementError(f"backend ray needs Ray on this host: {RAY_EXTRA}") from None
    return ray


def _short(node_id: str) -> str:
    return node_id[:12]


def unreachable(address: str) -> str | None:
    """Why nothing answers at a ``HOST:PORT`` cluster address (None: something does, or the address is
    another form, e.g. ``auto`` or ``ray://``, which Ray checks itself)."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        return f"nothing answers at {address}: {exc.strerror or exc}"
    return None


def nodes_lacking(asked: RayResources) -> str | None:
    """Why no alive node of the cluster could ever hold a replica asking for ``asked`` (resources in
    total, labels), or None when one could (it may be busy)."""
    ray = _ray()
    wants = {"CPU": asked.num_cpus, "GPU": asked.num_gpus, **asked.resources}
    alive = [n for n in ray.nodes() if n.get("Alive")]
    for node in alive:
        has, labels = node.get("Resources", {}), node.get("Labels", {}) or {}
        if all(has.get(k, 0.0) >= v for k, v in wants.items() if v > 0) and all(
            labels.get(k) == v for k, v in asked.node_labels.items()
        ):
            return None
    return f"no alive node of the Ray cluster has {asked.describe()} ({len(alive)} alive node(s))"


class RayPlacement(StagePlacement):
    """The placement of a deployment on a Ray cluster."""

    def __init__(self, deployment: ResolvedDeployment) -> None:
        assert deployment.ray is not None, "backend ray only"
        self.deployment = deployment
        self.settings = deployment.ray
        self.tag = uuid.uuid4().hex[:8]
        """Names this deployment's actors apart from other deployments on the same cluster."""
        self.head_node_id = ""
        self.clients: list[RayStageClient] = []
        self._connected = False
        self._all_placed: asyncio.Task[None] | None = None

    def place(
        self, deployment: ResolvedDeployment, stage: ResolvedStage, connectors: dict[str, OmniConnector]
    ) -> list[StageCoreClientBase]:
        self.connect()
        made = [RayStageClient(self, stage, r.replica_id, connectors) for r in stage.replicas]
        for client in made:
            client.create_actor()
        self.clients.extend(made)
        return list(made)

    def connect(self) -> None:
        """Join the running cluster as a driver (never start one): ``ray.address``, else ``RAY_ADDRESS``,
        else the cluster ``ray start`` made on this host."""
        ray = _ray()
        if self.head_node_id:
            return
        if not ray.is_initialized():
            address = self.settings.address or os.environ.get("RAY_ADDRESS") or "auto"
            why = unreachable(address)
            if why is not None:
                raise StagePlacementError(
                    f"backend ray: cannot join a Ray cluster ({why}); check ray.address or RAY_ADDRESS, "
                    "and that `ray start --head` runs there"
                )
            sigterm = signal.getsignal(signal.SIGTERM)
            try:
                ray.init(
                    address=address,
                    namespace=self.settings.namespace,
                    log_to_driver=True,
                    logging_level="WARNING",
                )
            except (ConnectionError, RuntimeError, ValueError) as exc:
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise StagePlacementError(
                    f"backend ray: cannot join a Ray cluster at {address} ({reason}); start one with "
                    "`ray start --head` (and `ray start --address=HEAD:6379` on the other hosts), or set "
                    "RAY_ADDRESS or the deploy config's ray.address"
                ) from None
            finally:
                # ray.init makes SIGTERM exit the process at once; the server drains on SIGTERM instead.
                if signal.getsignal(signal.SIGTERM) is not sigterm and sigterm is not None:
                    with contextlib.suppress(ValueError):
                        signal.signal(signal.SIGTERM, sigterm)
            self._connected = True
        self.head_node_id = ray.get_runtime_context().get_node_id()
        logger.info(
            "backend ray: joined the cluster (%d alive node(s)); the head runs on node %s",
            sum(1 for n in ray.nodes() if n.get("Alive")),
            _short(self.head_node_id),
        )

    async def wait_all_placed(self) -> None:
        """Every replica of the deployment has a place, or start-up fails naming the first that has
        none after ``placement_timeout_s`` (shared by all clients, so the deadline is one)."""
        if self._all_placed is None:
            self._all_placed = asyncio.ensure_future(self._place_all())
        await asyncio.shield(self._all_placed)

    async def _place_all(self) -> None:
        timeout = self.settings.placement_timeout_s
        pending = {c: asyncio.ensure_future(c.await_placed()) for c in self.clients}
        done, waiting = await asyncio.wait(pending.values(), timeout=timeout)
        for future in done:
            future.result()  # a replica that failed outright
        if not waiting:
            return
        for future in waiting:
            future.cancel()
        late = [c for c, f in pending.items() if f in waiting]
        loop = asyncio.get_running_loop()
        for client in late:
            lacking = await loop.run_in_executor(None, nodes_lacking, client.resources)
            if lacking is not None:
                raise StagePlacementError(
                    f"{client.label} cannot be placed: it asks for {client.resources.describe()} and "
                    f"{lacking} after {timeout:g} s (ray.placement_timeout_s)",
                    stage_id=client.stage_id,
                )
        client = late[0]
        raise StageStartError(
            f"{client.label} got no place within {timeout:g} s (ray.placement_timeout_s): nodes with "
            f"{client.resources.describe()} exist, but none took its actor in time (their resources are in "
            "use, or the actor's process is still starting)",
            stage_id=client.stage_id,
        )

    async def start(self) -> None:
        """Nothing beyond the clients: each one's start waited for every actor's place and loaded its own."""

    def abandon(self) -> None:
        """Start-up failed: stop every actor of the deployment, then kill it and free its placement group.

        A stop first, because an actor killed while its engine loads leaves the engine's processes and
        their shared memory behind; its stop ends them (``StageReplicaActor.shutdown``). The clients'
        shutdown, which follows, disconnects."""
        ray = _ray()
        stopping = []
        for client in self.clients:
            if client.actor is not None and client.where is not None:
                with best_effort("asking a Ray actor to stop", logger):
                    stopping.append(client.actor.shutdown.remote())
        if stopping:
            with best_effort("waiting for the deployment's Ray actors to stop", logger):
                ray.wait(stopping, num_returns=len(stopping), timeout=ABANDON_STOP_WAIT_S)
        for client in list(self.clients):
            client.kill()

    async def shutdown(self) -> None:
        """Nothing before the pools: each client's shutdown ends its actor and releases it here, the last
        one disconnecting from the cluster."""

    def health(self) -> dict[str, Any]:
        """The head's node and how many of the deployment's actors it holds."""
        return {"ray": {"head_node": self.head_node_id or None, "actors": len(self.clients)}}

    def release(self, client: RayStageClient) -> None:
        """A client shut down; the last one disconnects from the cluster (if this placement connected)."""
        if client in self.clients:
            self.clients.remove(client)
        if not self.clients and self._connected:
            self._connected = False
            with best_effort("disconnecting from the Ray cluster", logger):
                _ray().shutdown()


class RayStageClient(StageCoreClientBase):
    """One replica of a stage as a Ray actor, as pools and servers see any replica."""

    def __init__(
        self,
        owner: RayPlacement,
        stage: ResolvedStage,
        replica_id: int,
        connectors: dict[str, OmniConnector],
    ) -> None:
        super().__init__(stage.stage_id, replica_id, stage.name)
        assert stage.ray_resources is not None, "backend ray only"
        self.owner = owner
        self.stage = stage
        self.resources: RayResources = stage.ray_resources
        deployment = owner.deployment
        sources = stage.input_sources
        self.input_edge = deployment.edge(sources[0], stage.stage_id) if sources else None
        self.output_edge = deployment.edge(stage.stage_id, ROUTER) if stage.final_output else None
        self.connectors = connectors
        self.input_connector: OmniConnector | None = None
        self.output_connector: OmniConnector | None = None
        self.actor: Any = None
        self.placement_group: Any = None
        self.where: ActorPlaced | None = None
        self.waiting: str | None = None
        """Why the replica is not serving while Ray restarts it (e.g. no alive node has its resources),
        for ``/health``."""
        self.no_place = False
        """No alive node could hold the actor: the stage waits for the cluster, not for this host."""
        self.actor_name = f"omni-{owner.tag}-stage{stage.stage_id}-{stage.name}-replica{replica_id}"
        self._placed_ref: Any = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._requests = StageMessageCodec(Any)
        self._replies = StageMessageCodec(RemoteOutput)
        self._status = StageMessageCodec(StageReady | StageFailed)

    # --- identity and health ----------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The actor's process, on its own node."""
        return self.where.pid if self.where is not None and self.healthy else None

    @property
    def awaits_worker(self) -> bool:
        """Waiting for the cluster to have a node for the actor again, which is not a failure of the head
        (while Ray merely restarts it, the replica is down as a local process would be)."""
        return self.no_place and self.state == StageState.RESTARTING

    def health(self) -> dict[str, Any]:
        where = self.where if self.healthy else None
        return {
            **super().health(),
            "actor": self.actor_name,
            "node": where.node_id if where else None,
            "host": f"{where.host} ({where.node_ip})" if where else None,
            "waiting": self.waiting,
        }

    # --- start ------------------------------------------------------------------------------------

    def create_actor(self) -> None:
        """Ask Ray for the actor (and its placement group); Ray places it while other stages are built."""
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        p = self.resources
        options: dict[str, Any] = {
            "name": self.actor_name,
            "namespace": self.owner.settings.namespace,
            "num_cpus": p.num_cpus,
            "num_gpus": p.num_gpus,
            "resources": dict(p.resources),
            "max_restarts": p.max_restarts,
            "max_task_retries": 0,  # a request lost with its actor fails (or is retried) at the head
        }
        if p.node_labels:
            options["label_selector"] = dict(p.node_labels)
        if p.placement_group:
            bundle = {"CPU": p.num_cpus, "GPU": p.num_gpus, **p.resources}
            self.placement_group = ray.util.placement_group(
                [{k: v for k, v in bundle.items() if v > 0}],
                strategy="STRICT_PACK",
                name=self.actor_name,
                bundle_label_selector=[dict(p.node_labels)] if p.node_labels else None,
            )
            options.pop("label_selector", None)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
            )
        self.actor = ray.remote(StageReplicaActor).options(**options).remote(self._spec())
        self._placed_ref = self.actor.placed.remote()

    def _spec(self) -> bytes:
        stage, replica = self.stage, self.stage.replicas[self.replica_id]
        edges = [e for e in (self.input_edge, self.output_edge) if e is not None]
        names = {n for e in edges for n in (e.connector, e.same_node_connector) if n}
        connectors = self.owner.deployment.connectors
        spec = ReplicaSpec(
            stage_id=stage.stage_id,
            replica_id=self.replica_id,
            name=stage.name,
            execution_type=stage.execution_type,
            head_node_id=self.owner.head_node_id,
            engine_args=stage.engine_args,
            default_sampling_params=stage.default_sampling_params,
            diffusion_args=stage.diffusion_args,
            env=replica.env,
            input_edge=self.input_edge,
            output_edge=self.output_edge,
            connectors={n: connectors[n] for n in sorted(names)},
        )
        return msgspec.msgpack.encode(spec)

    async def await_placed(self) -> None:
        """Until Ray has placed the actor (the start-up barrier waits on this for every replica)."""
        ray = _ray()
        try:
            self.where = msgspec.msgpack.decode(await self._placed_ref, type=ActorPlaced)
        except ray.exceptions.RayActorError as exc:  # e.g. the plugin is not installed on that node
            cause = str(exc).strip().splitlines()
            raise StageStartError(
                f"{self.label}: its Ray actor could not start ({cause[0] if cause else type(exc).__name__}); "
                "see the Ray logs of its node",
                stage_id=self.stage_id,
            ) from None

    async def start(self) -> None:
        try:
            await self.owner.wait_all_placed()
            await self._load()
        except BaseException:
            self.owner.abandon()  # start-up fails as a whole: no actor of it may stay behind
            raise
        self._tasks.append(asyncio.create_task(self._watch(), name=f"{self.label} watch"))
        if self.stage.execution_type != "llm_ar":
            self._tasks.append(asyncio.create_task(self._progress(), name=f"{self.label} progress"))

    async def _load(self) -> None:
        """Load the stage in the placed actor and pick this replica's connectors from its node."""
        assert self.where is not None
        self._pick_connectors(self.where)
        status = self._status.decode(await self.actor.ready.remote())
        if isinstance(status, StageFailed):
            raise StageStartError(
                f"{self.label} failed to start on {self.where.host}: {status.error}", stage_id=self.stage_id
            )
        self.state = StageState.READY
        self.weight_bytes = status.weight_bytes
        self.waiting, self.no_place = None, False
        logger.info(
            "%s ready: Ray actor %s on node %s (%s, pid %d), loaded in %.1fs",
            self.label,
            self.actor_name,
            _short(self.where.node_id),
            self.where.host,
            self.where.pid,
            status.load_seconds,
        )

    def _pick_connectors(self, where: ActorPlaced) -> None:
        same_node = where.node_id == self.owner.head_node_id
        picked: list[OmniConnector | None] = []
        for edge in (self.input_edge, self.output_edge):
            if edge is None:
                picked.append(None)
                continue
            name = edge.connector_between(same_node)
            connector = self.connectors.get(name)
            if (
                connector is not None
                and not same_node
                and type(connector).__name__ == "SharedMemoryConnector"
            ):
                raise StageStartError(
                    f"{self.label} runs on node {_short(where.node_id)} ({where.host}), not the head's, and "
                    f"edge {edge.from_stage} -> {edge.to} uses the SharedMemoryConnector {name!r}, which "
                    "reaches processes on one node only; use NixlConnector with same_node_connector",
                    stage_id=self.stage_id,
                )
            picked.append(connector)
        self.input_connector, self.output_connector = picked

    # --- liveness: Ray tells us -------------------------------------------------------------------

    async def _watch(self) -> None:
        ray = _ray()
        while True:
            try:
                await self.actor.watch.remote()
                return  # the actor was shut down
            except ray.exceptions.RayActorError as exc:
                if self.state == StageState.STOPPED:
                    return
                await self._recover(exc)
                if self.state != StageState.READY:
                    return

    async def _recover(self, lost: BaseException) -> None:
        """The actor died (Ray says so): wait for Ray's restart, then load the stage again."""
        ray = _ray()
        before = self.where
        logger.error(
            "%s: Ray reports its actor lost (%s); failing %d in-flight request(s)",
            self.label,
            type(lost).__name__,
            len(self.inflight),
        )
        self.state = StageState.RESTARTING
        if not self.restart_on_death:
            with best_effort("killing the Ray actor of a replica that stays down", logger, warn=True):
                ray.kill(self.actor, no_restart=True)
            self.state = StageState.DEAD
            return
        loop = asyncio.get_running_loop()
        while self.state == StageState.RESTARTING:
            try:
                where = msgspec.msgpack.decode(
                    await asyncio.wait_for(self.actor.placed.remote(), RECOVER_POLL_S * 4), type=ActorPlaced
                )
            except ray.exceptions.ActorDiedError as exc:
                self.waiting, self.no_place = None, False
                self.state = StageState.DEAD
                logger.error("%s: Ray will not restart its actor (%s)", self.label, str(exc).splitlines()[0])
                return
            except (ray.exceptions.RayActorError, TimeoutError):
                lacking = await loop.run_in_executor(None, nodes_lacking, self.resources)
                self.waiting = lacking or "Ray is restarting the actor"
                self.no_place = lacking is not None
                await asyncio.sleep(RECOVER_POLL_S)
                continue
            if before is not None and (where.node_id, where.pid) == (before.node_id, before.pid):
                self.where = where  # the same incarnation answered again: a lost call, not a dead actor
                self.state = StageState.READY
                self.waiting, self.no_place = None, False
                return
            self.where = where
            self.waiting = f"loading the stage on node {_short(where.node_id)} ({where.host})"
            self.no_place = False
            try:
                await self._load()
            except StageError as exc:
                logger.error("%s could not be restarted: %s", self.label, exc)
                self.waiting, self.no_place = None, False
                self.state = StageState.DEAD
                return
            except ray.exceptions.RayActorError:
                continue  # lost again while loading
            self.restarts += 1
            self.count_steps_anew()

    async def _progress(self) -> None:
        """Ask the actor for its denoising steps while it serves (for /metrics); deaths are _watch's."""
        while True:
            await asyncio.sleep(PROGRESS_REPORT_INTERVAL_S)
            if self.state != StageState.READY:
                continue
            with best_effort("asking a Ray actor for its diffusion counts", logger):
                reported = await self.actor.diffusion_counters.remote()
                self.count_steps(msgspec.msgpack.decode(reported, type=DiffusionCounters))

    # --- requests ---------------------------------------------------------------------------------

    async def generate(self, request: Any) -> Any:
        if self.state != StageState.READY:
            raise StageDeadError(
                f"{self.label} is {self.state.value}", stage_id=self.stage_id, where="unsent"
            )
        request, put_seconds = send_request_through(request, self.input_connector)
        self.inflight.add(request.request_id)
        ref = self.actor.generate.remote(self._requests.encode(request))
        try:
            with released_if_replica_dies(request, self.input_connector):
                data = await self._reply(ref, request.request_id)
        except asyncio.CancelledError:
            await self.abort([request.request_id])
            self._discard_later(ref)
            raise
        finally:
            self.inflight.discard(request.request_id)
        message: RemoteOutput = self._replies.decode(data)
        return remote_stage_output(message, self.label, self.stage_id, put_seconds, self.output_connector)

    async def _reply(self, ref: Any, request_id: str) -> Any:
        """The actor's reply, its loss as the stage errors."""
        ray = _ray()
        try:
            return await ref
        except ray.exceptions.RayActorError as exc:
            raise StageDeadError(
                f"{self.label}: its Ray actor was lost while serving this request ({type(exc).__name__}); "
                "Ray restarts it",
                stage_id=self.stage_id,
                request_id=request_id,
            ) from None
        except ray.exceptions.TaskCancelledError:
            raise RequestAbortedError("aborted", stage_id=self.stage_id, request_id=request_id) from None

    def _discard_later(self, ref: Any) -> None:
        """A reply nobody waits for any more may still hold an image in the output connector: free it."""

        async def discard() -> None:
            with best_effort("freeing the output of a Ray reply nobody waits for", logger):
                message: RemoteOutput = self._replies.decode(await asyncio.wait_for(ref, SHUTDOWN_WAIT_S))
                discard_output(message.output, self.output_connector)

        task = asyncio.ensure_future(discard())
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def abort(self, request_ids: list[str]) -> None:
        if self.actor is not None and self.state == StageState.READY:
            with best_effort("aborting requests on a Ray actor", logger):
                await self.actor.abort.remote(
                    msgspec.msgpack.encode(StageAbort(request_ids=list(request_ids)))
                )

    async def log_stats(self) -> None:
        if self.actor is not None and self.healthy:
            with best_effort("asking a Ray actor to log its stats", logger):
                await self.actor.log_stats.remote()

    async def shutdown(self) -> None:
        self.state = StageState.STOPPED
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.actor is not None and self.where is not None:
            with best_effort("stopping a Ray actor", logger):
                await asyncio.wait_for(self.actor.shutdown.remote(), SHUTDOWN_WAIT_S)
        self.kill()
        self.owner.release(self)

    def kill(self) -> None:
        """End the actor for good (no restart) and free its placement group."""
        ray = _ray()
        self.state = StageState.STOPPED
        if self.actor is not None:
            with best_effort("killing a Ray actor", logger, warn=True):
                ray.kill(self.actor, no_restart=True)
            self.actor = None
        if self.placement_group is not None:
            with best_effort("removing a Ray placement group", logger, warn=True):
                ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
