"""``StageCoreClientBase``: how the orchestrator talks to one replica of one stage."""

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
    """One replica of one stage. Every method is called from the orchestrator's event loop."""

    def __init__(self, stage_id: int, replica_id: int, name: str) -> None:
        self.stage_id = stage_id
        self.replica_id = replica_id
        self.name = name
        self.state = StageState.STARTING
        self.inflight: set[str] = set()
        self.restarts = 0

    @property
    def label(self) -> str:
        return f"stage {self.stage_id} ({self.name}) replica {self.replica_id}"

    @property
    def healthy(self) -> bool:
        return self.state == StageState.READY

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
