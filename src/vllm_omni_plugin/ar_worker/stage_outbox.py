"""Per-request outputs for the next stage, held in an AR stage's worker process until a step carries them.

Who records: the model's ``omni_stage_outputs(mm_features)`` (GLM-Image's source-image prior tokens), asked
once per new request, by the V1 runner mixin (``_update_states``) or by the V2 model state
(``add_request``, the one V2 seam that sees a new request with its features and the model). Who takes: the
V1 runner, onto the step's ``ModelRunnerOutput`` for the requests that ran; the plugin's KV connector
(``ar_worker/context_export.py``), into its worker metadata: V2's only way from a worker to the scheduler.
Either way the Omni scheduler holds them until the request's final output.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any


class StageOutbox:
    """Outputs by request id, each taken once."""

    def __init__(self) -> None:
        self._pending: dict[str, dict[str, Any]] = {}

    def record(self, req_id: str, outputs: dict[str, Any]) -> None:
        self._pending.setdefault(req_id, {}).update(outputs)

    def take(self, req_ids: Container[str] | None = None) -> dict[str, dict[str, Any]]:
        """What is held for ``req_ids`` (None: for every request), removed."""
        ready = [rid for rid in self._pending if req_ids is None or rid in req_ids]
        return {rid: self._pending.pop(rid) for rid in ready}


STAGE_OUTBOX = StageOutbox()
"""This worker process's outbox (one engine per vLLM worker process)."""


def record_model_stage_outputs(model: Any, req_id: str, mm_features: list[Any] | None) -> None:
    """Ask a model with per-request outputs for the next stage (``omni_stage_outputs``) about a new
    request, and hold what it returns."""
    hook = getattr(model, "omni_stage_outputs", None)
    if hook is None or not mm_features:
        return
    outputs = hook(mm_features)
    if outputs:
        STAGE_OUTBOX.record(req_id, outputs)
