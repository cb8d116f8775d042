"""What the Omni workers add to vLLM's CPU and GPU workers, whatever the platform and model runner."""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_omni_plugin.compat import resolve, vllm_version
from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)
_logged_runner: list[bool] = []


def context_export_connector() -> Any:
    """This worker process's context export KV connector (``ar_worker/context_export.py``), if any."""
    if not resolve("has_kv_transfer_group")():
        return None
    connector = resolve("get_kv_transfer_group")()
    return connector if hasattr(connector, "take_stage_outputs") else None


def log_model_runner(v2: bool) -> None:
    """Say once per worker process which of vLLM's model runners this AR stage's worker builds, and so
    where its omni behaviour comes from."""
    if _logged_runner:
        return
    _logged_runner.append(v2)
    if v2:
        logger.info(
            "AR stage on vLLM's V2 model runner (%s): decode positions through the model state, stage "
            "outputs and context exports through the KV connector",
            vllm_version(),
        )
    else:
        logger.info("AR stage on vLLM's V1 model runner (%s) with the Omni runner hooks", vllm_version())


class OmniWorkerMixin:
    """Mixed in front of vLLM's worker class (``CPUWorker``, ``Worker``)."""

    def omni_context_connector_health(self) -> dict[str, Any] | None:
        """Counters of the context connector in this worker (``collective_rpc`` target): whoever serves
        ``/metrics`` and the leak checks see the sending side of a KV handoff through it."""
        connector = context_export_connector()
        health = connector.health() if connector is not None else None
        return None if health is None else msgspec.to_builtins(health)
