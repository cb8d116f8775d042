"""``StageCoreClientBase``: one replica of one stage, as replica pools and servers see it."""

from __future__ import annotations

import abc
import asyncio
import collections
import enum
from typing import Any, ClassVar

from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.core_types import StageCoreOutput
from vllm_omni_plugin.stage.errors import StageDeadError

logger = get_logger(__name__)


class StageState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    DEAD = "dead"
    STOPPED = "stopped"


class StageCoreClientBase(abc.ABC):
    """One replica of one stage. Every method is called from the orchestrator's event loop.

    What pools and servers may use is declared here and nowhere else: identity (``stage_id``,
    ``replica_id``, ``name``, ``label``), the process serving it (``pid``), health (``state``,
    ``healthy``, ``inflight``, ``restarts``, ``awaits_worker``, ``health()``), the restart policy
    (``restart_on_death``), what it saw (``deaths``, ``dropped``, ``discarded_outputs``), stats
    (``log_stats``, ``denoise_steps``) and the request calls (``generate``, ``abort``).

    However a placement learns that a replica's process died (a local process's exit, an engine's
    dead-engine error, a remote worker's silence, a cluster scheduler's actor-death event), it reports it
    through :meth:`replica_died` and fails the replica's in-flight requests with the error that returns;
    the orchestrator retries those within each request's budget.
    """

    holds_environment_while_loading: ClassVar[bool] = False
    """Its start keeps this process's environment (``temporary_environment``) until the replica has
    loaded (vLLM's engine): no other stage's process can start meanwhile, so such stages start last."""

    def __init__(self, stage_id: int, replica_id: int, name: str, *, restart: bool = True) -> None:
        self.launched = asyncio.Event()
        """Set once the replica's processes run, while they may still load: the next stage's replicas
        may start beside them (replicas that do not set it count as launched when their start ends)."""
        self.stage_id = stage_id
        self.replica_id = replica_id
        self.name = name
        self.state = StageState.STARTING
        self.inflight: set[str] = set()
        """Ids of the requests this replica is working on."""
        self.restarts = 0
        self.restart_on_death = restart
        """Whether a replica whose process died is started again (servers turn this off on shutdown)."""
        self.last_connector_stats: list[dict[str, Any]] = []
        """What :meth:`connector_stats` said at the last stats interval (``/metrics`` reads it)."""
        self.weight_bytes = 0
        """A diffusion replica's weights as its engine holds them, once loaded (``/metrics``)."""
        self.diffusion = DiffusionCounters()
        """What this replica's diffusion engine counted (denoising steps, step and queue times), kept
        across restarts (diffusion replicas report it as they go; zeros for the others)."""
        self._counted_earlier = DiffusionCounters()
        """The counts of the processes (workers, actors) this replica ran before its current one."""
        self.deaths = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        """Aborted requests the replica dropped, by where they were: ``queue`` (not started), ``batch``
        (dropped from a running batch, no image made), ``engine`` (aborted in the AR engine)."""
        self.discarded_outputs = 0
        """Outputs that arrived after their request was aborted, freed unread."""

    @property
    def label(self) -> str:
        return f"stage {self.stage_id} ({self.name}) replica {self.replica_id}"

    @property
    def denoise_steps(self) -> int:
        """Denoising steps this replica ran, counted per request."""
        return self.diffusion.denoise_steps

    def count_steps(self, reported: DiffusionCounters) -> None:
        """``reported``: the running counts of the replica's current process."""
        self.diffusion = self._counted_earlier.plus(reported)

    def count_steps_anew(self) -> None:
        """The replica's process was replaced (a restart, a worker that joined again): the new one counts
        from 0, and ``diffusion`` keeps what the old ones counted."""
        self._counted_earlier = self.diffusion

    @property
    def healthy(self) -> bool:
        return self.state == StageState.READY

    @property
    def pid(self) -> int | None:
        """The process that serves this replica (on its own host for a remote one); None while none does."""
        return None

    @property
    def awaits_worker(self) -> bool:
        """Served by a worker on another host that is not there (yet or any more): the stage waits for
        it to join, which is not a failure of this host."""
        return False

    def health(self) -> dict[str, Any]:
        """This replica's entry in ``/health``."""
        return {
            "replica_id": self.replica_id,
            "state": self.state.value,
            "inflight": len(self.inflight),
            "restarts": self.restarts,
            "pid": self.pid,
        }

    def replica_died(self, cause: str) -> StageDeadError:
        """Record that this replica's process died (``cause`` says how); the state follows the restart
        policy. Returns the error its in-flight requests fail with."""
        self.deaths += 1
        self.state = StageState.RESTARTING if self.restart_on_death else StageState.DEAD
        logger.error(
            "%s died (%s) with %d request(s) in flight%s",
            self.label,
            cause,
            len(self.inflight),
            "; restarting it" if self.restart_on_death else "",
        )
        return StageDeadError(
            f"{self.label} died ({cause}) while serving this request", stage_id=self.stage_id
        )

    async def log_stats(self) -> None:  # noqa: B027 - a hook: replicas without stats log nothing
        """Log the replica's periodic stats (vLLM's throughput lines for an AR engine)."""

    async def connector_stats(self) -> list[dict[str, Any]]:
        """Counters of the connectors the replica's own processes put through (``ConnectorHealth`` as
        builtins), e.g. an AR worker's context export; empty when it has none."""
        return []

    @abc.abstractmethod
    async def start(self) -> None:
        """Start the replica and return when it can take requests (raises StageStartError)."""

    @abc.abstractmethod
    async def generate(self, request: Any) -> StageCoreOutput:
        """Run one request to completion (raises StageError / StageDeadError)."""

    @abc.abstractmethod
    async def abort(self, request_ids: list[str]) -> None:
        """Stop working on these requests (their ``generate`` calls end with RequestAbortedError)."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the replica and release everything it holds."""
