"""``StageReplicaPool``: the replicas of one stage, least-loaded routing and replica health."""

from __future__ import annotations

import asyncio
from typing import Any

from vllm_omni_plugin.stage.core_client import StageCoreClientBase, StageState
from vllm_omni_plugin.stage.core_types import StageCoreOutput
from vllm_omni_plugin.stage.errors import StageDeadError

RESTART_WAIT_S = 300.0
LAUNCH_POLL_S = 0.05


class StageReplicaPool:
    def __init__(self, stage_id: int, name: str, clients: list[StageCoreClientBase]) -> None:
        if not clients:
            raise ValueError(f"stage {stage_id} has no replicas")
        self.stage_id = stage_id
        self.name = name
        self.clients = clients

    async def start(self) -> None:
        results = await asyncio.gather(*(c.start() for c in self.clients), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.shutdown()
            raise errors[0]

    @property
    def holds_environment_while_loading(self) -> bool:
        return any(c.holds_environment_while_loading for c in self.clients)

    async def launched(self, starting: asyncio.Task[None]) -> None:
        """Returns once every replica's processes run (they may still load) or ``starting``, the pool's
        start, has ended (its outcome is left to whoever awaits it)."""
        while not starting.done() and not all(c.launched.is_set() for c in self.clients):
            await asyncio.wait({starting}, timeout=LAUNCH_POLL_S)

    def pick(self) -> StageCoreClientBase:
        """The healthy replica with the fewest requests in flight."""
        healthy = [c for c in self.clients if c.healthy]
        if not healthy:
            states = ", ".join(f"replica {c.replica_id}: {c.state.value}" for c in self.clients)
            raise StageDeadError(
                f"stage {self.stage_id} ({self.name}) has no healthy replica ({states})",
                stage_id=self.stage_id,
                where="unsent",
            )
        return min(healthy, key=lambda c: (len(c.inflight), c.replica_id))

    async def acquire(self, timeout: float = RESTART_WAIT_S) -> StageCoreClientBase:
        """A healthy replica; waits while replicas are (re)starting rather than failing the request."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                return self.pick()
            except StageDeadError:
                recovering = any(
                    c.state in (StageState.STARTING, StageState.RESTARTING) for c in self.clients
                )
                if not recovering or asyncio.get_running_loop().time() > deadline:
                    raise
            await asyncio.sleep(0.05)

    async def generate(self, request: Any) -> StageCoreOutput:
        return await (await self.acquire()).generate(request)

    async def abort(self, request_ids: list[str]) -> None:
        await asyncio.gather(*(c.abort(request_ids) for c in self.clients), return_exceptions=True)

    async def shutdown(self) -> None:
        await asyncio.gather(*(c.shutdown() for c in self.clients), return_exceptions=True)

    def stop_restarting(self) -> None:
        """From now on a replica that dies stays down (the server is shutting down)."""
        for client in self.clients:
            client.restart_on_death = False

    @property
    def healthy(self) -> bool:
        return any(c.healthy for c in self.clients)

    @property
    def awaits_worker(self) -> bool:
        """Down only because its remote workers are away (they rejoin; this host is fine)."""
        return not self.healthy and all(c.awaits_worker for c in self.clients)

    @property
    def queue_depth(self) -> int:
        return sum(len(c.inflight) for c in self.clients)

    def health(self) -> dict[str, Any]:
        return {
            "stage_id": self.stage_id,
            "name": self.name,
            "healthy": self.healthy,
            "replicas": [c.health() for c in self.clients],
        }
