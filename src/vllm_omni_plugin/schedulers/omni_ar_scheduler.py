"""``OmniARScheduler`` / ``OmniARAsyncScheduler``: one omni behaviour on either vLLM scheduler base.

Like vLLM's ``AsyncScheduler`` extends ``Scheduler`` through two hooks, ``OmniARSchedulerMixin`` adds
the omni behaviour through a few overrides and is placed in front of either base; configuration
resolution picks the variant from the final ``async_scheduling`` flag.

- ``all_token_ids`` is filled for every request the model runner may have to rebuild (resumed, or
  absent from its persistent batch), whatever the base or the runner version: the runner's async resume
  path reads it (shared/seeds/000: a missing entry killed the engine core).
- A request the runner had to leave out of a step (it could not be rebuilt) is finished with an error
  that reaches its client, instead of a ``KeyError`` that would kill the engine core.
- Per-request stage outputs from the runner (``ModelRunnerOutput.omni_stage_outputs``) travel back with
  the request's output under ``kv_transfer_params["omni"]``, vLLM's per-request dict channel to the
  client.
- Hooks for KV-handoff pipelines: ``on_prefill_finished`` and ``on_trigger_token`` (token ids listed in
  ``SamplingParams.extra_args["omni"]["trigger_token_ids"]``).
"""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.compat import resolve
from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

Scheduler = resolve("Scheduler")
AsyncScheduler = resolve("AsyncScheduler")

OMNI_KEY = "omni"
RUNNER_DROPPED_MESSAGE = "the AR stage could not rebuild this request after preemption"


def _omni_args(request: Any) -> dict[str, Any]:
    params = getattr(request, "sampling_params", None)
    extra = (getattr(params, "extra_args", None) or {}) if params is not None else {}
    value = extra.get(OMNI_KEY) or {}
    return value if isinstance(value, dict) else {}


class OmniARSchedulerMixin:
    """Omni behaviour shared by both scheduler variants."""

    requests: dict[str, Any]

    # --- hooks (override in subclasses; called once per event) ---

    def on_prefill_finished(self, request: Any) -> None:
        """The request's prompt has been fully computed in this step."""

    def on_trigger_token(self, request: Any, token_id: int) -> None:
        """The request generated one of its ``trigger_token_ids``."""

    # --- all_token_ids for every request the runner may rebuild ---

    def _make_cached_request_data(
        self,
        running_reqs: list[Any],
        resumed_reqs: list[Any],
        num_scheduled_tokens: dict[str, int],
        spec_decode_tokens: dict[str, list[int]],
        req_to_new_blocks: dict[str, Any],
    ) -> Any:
        data = super()._make_cached_request_data(  # type: ignore[misc]
            running_reqs, resumed_reqs, num_scheduled_tokens, spec_decode_tokens, req_to_new_blocks
        )
        previous = getattr(self, "prev_step_scheduled_req_ids", set())
        for request in (*running_reqs, *resumed_reqs):
            req_id = request.request_id
            if req_id in data.all_token_ids:
                continue
            if req_id in data.resumed_req_ids or req_id not in previous:
                data.all_token_ids[req_id] = request.all_token_ids.copy()
        return data

    # --- outputs ---

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        dropped = self._fail_dropped_requests(scheduler_output, model_runner_output)
        # Looked up before the base class retires finished requests.
        scheduled = {
            req_id: request
            for req_id in scheduler_output.num_scheduled_tokens
            if (request := self.requests.get(req_id)) is not None
        }
        prefilling = [r for r in scheduled.values() if r.num_computed_tokens < r.num_prompt_tokens]
        outputs: dict[int, Any] = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
        self._attach_stage_outputs(outputs, getattr(model_runner_output, "omni_stage_outputs", None))
        self._run_hooks(outputs, scheduled, prefilling)
        for client_index, output in dropped:
            bucket = outputs.get(client_index)
            if bucket is None:
                EngineCoreOutputs = resolve("EngineCoreOutputs")
                bucket = outputs[client_index] = EngineCoreOutputs(engine_index=0, outputs=[])
            bucket.outputs.append(output)
        return outputs

    def _fail_dropped_requests(
        self, scheduler_output: Any, model_runner_output: Any
    ) -> list[tuple[int, Any]]:
        index = getattr(model_runner_output, "req_id_to_index", None)
        if index is None:
            return []
        missing = [
            req_id
            for req_id in scheduler_output.num_scheduled_tokens
            if req_id not in index
            and (request := self.requests.get(req_id)) is not None
            and not request.is_finished()
        ]
        if not missing:
            return []
        RequestStatus = resolve("RequestStatus")
        FinishReason = resolve("FinishReason")
        EngineCoreOutput = resolve("EngineCoreOutput")
        failed = self.finish_requests(missing, RequestStatus.FINISHED_ERROR)  # type: ignore[attr-defined]
        out = []
        for request in failed:
            logger.error("request %s failed: %s", request.request_id, RUNNER_DROPPED_MESSAGE)
            out.append(
                (
                    request.client_index,
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        finish_reason=FinishReason.ERROR,
                        stop_reason=RUNNER_DROPPED_MESSAGE,
                    ),
                )
            )
        return out

    @staticmethod
    def _attach_stage_outputs(outputs: dict[int, Any], stage_outputs: dict[str, dict] | None) -> None:
        if not stage_outputs:
            return
        for bucket in outputs.values():
            for output in bucket.outputs:
                extra = stage_outputs.get(output.request_id)
                if extra:
                    params = dict(output.kv_transfer_params or {})
                    params.setdefault(OMNI_KEY, {}).update(extra)
                    output.kv_transfer_params = params

    def _run_hooks(self, outputs: dict[int, Any], scheduled: dict[str, Any], prefilling: list[Any]) -> None:
        for request in prefilling:
            if request.num_computed_tokens >= request.num_prompt_tokens:
                self.on_prefill_finished(request)
        for bucket in outputs.values():
            for output in bucket.outputs:
                if not output.new_token_ids:
                    continue
                request = scheduled.get(output.request_id)
                triggers = _omni_args(request).get("trigger_token_ids") if request is not None else None
                if triggers:
                    for token_id in output.new_token_ids:
                        if token_id in triggers:
                            self.on_trigger_token(request, token_id)


class OmniARScheduler(OmniARSchedulerMixin, Scheduler):  # type: ignore[misc, valid-type]
    pass


class OmniARAsyncScheduler(OmniARSchedulerMixin, AsyncScheduler):  # type: ignore[misc, valid-type]
    pass
