"""What the Omni workers add to vLLM's CPU and GPU workers, whatever the platform."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec


class OmniWorkerMixin:
    """Mixed in front of vLLM's worker class (``CPUWorker``, ``Worker``)."""

    model_runner: Any

    def _context_exporter(self) -> Any:
        runner = getattr(self, "model_runner", None)
        return getattr(runner, "context_exporter", None)

    def omni_context_connector_health(self) -> dict[str, Any] | None:
        """Counters of the context connector in this worker (``collective_rpc`` target): whoever serves
        ``/metrics`` and the leak checks see the sending side of a KV handoff through it."""
        exporter = self._context_exporter()
        health = exporter.health() if exporter is not None else None
        return None if health is None else msgspec.to_builtins(health)

    def shutdown(self) -> None:
        exporter = self._context_exporter()
        if exporter is not None:
            with contextlib.suppress(Exception):  # the rest of the shutdown must run
                exporter.close()
        super().shutdown()
