"""``StageCoreClientBase``: one replica of one stage, as replica pools and servers see it."""

from __future__ import annotations

import abc
import enum
from typing import Any

from vllm_omni_plugin.stage.core_types import StageCoreOutput


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
    (``restart_on_death``), stats (``log_stats``, ``denoise_steps``) and the request calls (``generate``,
    ``abort``).
    """

    def __init__(self, stage_id: int, replica_id: int, name: str, *, restart: bool = True) -> None:
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
        self.denoise_steps = 0
        """Denoising steps this replica ran, counted per request, kept across restarts (diffusion
        replicas report it as they go; 0 for the others)."""

    @property
    def label(self) -> str:
        return f"stage {self.stage_id} ({self.name}) replica {self.replica_id}"

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
