"""``OmniARScheduler`` / ``OmniARAsyncScheduler``: one omni behaviour on either vLLM scheduler base.

Like vLLM's ``AsyncScheduler`` extends ``Scheduler`` through two hooks, ``OmniARSchedulerMixin`` adds
the omni behaviour through a few overrides and is placed in front of either base; configuration
resolution picks the variant from the final ``async_scheduling`` flag.

- ``all_token_ids`` is filled for every request vLLM's V1 model runner may have to rebuild (resumed, or
  absent from its persistent batch), whatever the base: the runner's async resume path reads it (a
  missing entry once killed an engine core in production, see ``docs/architecture.md``). vLLM's V2 model
  runner never reads it (a resumed request comes back whole), so with V2 nothing is added.
- A request the runner had to leave out of a step (``OmniRunnerOutput.dropped_req_ids``: it could not
  be rebuilt) is finished with an error that reaches its client, instead of a ``KeyError`` that would
  kill the engine core.
- Per-request stage outputs from the runner (``OmniRunnerOutput.stage_outputs``) and from the context
  export KV connector (``ar_worker/context_export.py``, whose worker metadata vLLM reads after it finished
  the step's requests) travel back with the request's final output under ``kv_transfer_params["omni"]``,
  vLLM's per-request dict channel to the client.
- Hooks for KV-handoff pipelines: ``on_prefill_finished`` and ``on_trigger_token`` (token ids listed in
  ``SamplingParams.extra_args["omni"]["trigger_token_ids"]``).
- The EngineCore process it runs in stops when the process that started it dies (vLLM's EngineCore
  would otherwise outlive a SIGKILLed API server, holding its shared memory): built in that process
  and only in omni deployments, the scheduler is where the watch starts.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import TYPE_CHECKING, Any

from vllm_omni_plugin.ar_channel import OMNI_KEY, RUNNER_DROPPED_MESSAGE, omni_extra_args, runner_extras
from vllm_omni_plugin.compat import resolve, uses_v2_model_runner
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.processes import exit_with_parent
from vllm_omni_plugin.test_hooks import hold_point

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

logger = get_logger(__name__)

Scheduler = resolve("Scheduler")
AsyncScheduler = resolve("AsyncScheduler")


class OmniARSchedulerMixin:
    """Omni behaviour shared by both scheduler variants."""

    requests: dict[str, Request]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._omni_triggers: dict[str, frozenset[int]] = {}
        """Request id -> its ``trigger_token_ids`` (requests that have any)."""
        self._omni_stage_outputs: dict[str, dict[str, Any]] = {}
        """Stage outputs the runner computed, held until their request's final output."""
        self._omni_fills_all_token_ids = not uses_v2_model_runner(self.vllm_config)
        """Only vLLM's V1 model runner reads ``CachedRequestData.all_token_ids`` (gone with V1 in 0.34,
        where a resumed request is sent again whole, as new request data)."""
        exit_with_parent("EngineCore")
        hold_point("ar.load", f"EngineCore {os.getpid()}")

    # --- hooks (override in subclasses; called once per event) ---

    def on_prefill_finished(self, request: Request) -> None:
        """The request's prompt has been fully computed in this step."""

    def on_trigger_token(self, request: Request | None, token_id: int) -> None:
        """The request generated one of its ``trigger_token_ids``."""

    # --- all_token_ids for every request the runner may rebuild ---

    def _make_cached_request_data(self, *args: Any, **kwargs: Any) -> CachedRequestData:
        # vLLM <= 0.33: (running_reqs, resumed_reqs, num_scheduled_tokens, spec_decode_tokens,
        # req_to_new_blocks); 0.34 dropped resumed_reqs. Passed on as given, read by name.
        data = super()._make_cached_request_data(*args, **kwargs)
        if not self._omni_fills_all_token_ids:
            return data
        given = _cached_data_parameters(type(self)).bind(self, *args, **kwargs).arguments
        running_reqs, resumed_reqs = given["running_reqs"], given.get("resumed_reqs", ())
        previous = getattr(self, "prev_step_scheduled_req_ids", set())  # absent in some vLLM versions
        for request in (*running_reqs, *resumed_reqs):
            req_id = request.request_id
            if req_id in data.all_token_ids:
                continue
            if req_id in data.resumed_req_ids or req_id not in previous:
                data.all_token_ids[req_id] = request.all_token_ids.copy()
        return data

    # --- outputs ---

    def add_request(self, request: Request) -> None:
        triggers = omni_extra_args(request.sampling_params).get("trigger_token_ids")
        if triggers:
            self._omni_triggers[request.request_id] = frozenset(triggers)
        super().add_request(request)

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        for request in finished:
            self._omni_triggers.pop(request.request_id, None)
            self._omni_stage_outputs.pop(request.request_id, None)
        return finished

    def _hooks_active(self) -> bool:
        overridden = type(self).on_prefill_finished is not OmniARSchedulerMixin.on_prefill_finished
        return bool(self._omni_triggers) or overridden

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        if scheduler_output.num_scheduled_tokens:  # tests hold work here (off unless a test arms it)
            hold_point("ar.step", " ".join(scheduler_output.num_scheduled_tokens))
        extras = runner_extras(model_runner_output)
        dropped = self._fail_dropped_requests(extras.dropped_req_ids if extras else [])
        hooks = self._hooks_active()
        prefilling: list[Request] = []
        watched: dict[str, Request | None] = {}
        if hooks:  # looked up before the base class retires finished requests
            watched = {rid: self.requests.get(rid) for rid in self._omni_triggers}
            # num_computed_tokens already counts this step's tokens (advanced at schedule time)
            prefilling = [
                request
                for req_id, n in scheduler_output.num_scheduled_tokens.items()
                if (request := self.requests.get(req_id)) is not None
                and request.num_computed_tokens - n < request.num_prompt_tokens <= request.num_computed_tokens
            ]
        outputs: dict[int, EngineCoreOutputs] = super().update_from_output(
            scheduler_output, model_runner_output
        )
        stage_outputs = dict(extras.stage_outputs) if extras else {}
        take = getattr(self.connector, "take_stage_outputs", None)  # the context export connector
        if take is not None:
            stage_outputs.update(take())
        self._attach_stage_outputs(outputs, stage_outputs)
        if hooks:
            self._run_hooks(outputs, prefilling, watched)
        for client_index, output in dropped:
            bucket = outputs.get(client_index)
            if bucket is None:
                bucket = outputs[client_index] = resolve("EngineCoreOutputs")(engine_index=0, outputs=[])
            bucket.outputs.append(output)
        return outputs

    def _fail_dropped_requests(self, dropped_req_ids: list[str]) -> list[tuple[int, EngineCoreOutput]]:
        """Finish the requests the runner left out with an error; their outputs, by client index."""
        missing = [
            req_id
            for req_id in dropped_req_ids
            if (request := self.requests.get(req_id)) is not None and not request.is_finished()
        ]
        if not missing:
            return []
        RequestStatus = resolve("RequestStatus")
        FinishReason = resolve("FinishReason")
        EngineCoreOutput = resolve("EngineCoreOutput")
        out = []
        for request in self.finish_requests(missing, RequestStatus.FINISHED_ERROR):
            logger.error("request %s failed: %s", request.request_id, RUNNER_DROPPED_MESSAGE)
            output = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                stop_reason=RUNNER_DROPPED_MESSAGE,
            )
            out.append((request.client_index, output))
        return out

    def _attach_stage_outputs(
        self, outputs: dict[int, EngineCoreOutputs], stage_outputs: dict[str, dict[str, Any]]
    ) -> None:
        """Stage outputs arrive when the runner computed them; they leave with the request's final
        output (vLLM hands ``kv_transfer_params`` of the finishing output to the client)."""
        held = self._omni_stage_outputs
        for req_id, extra in stage_outputs.items():
            held.setdefault(req_id, {}).update(extra)
        if not held:
            return
        for bucket in outputs.values():
            for output in bucket.outputs:
                if output.finish_reason is None or output.request_id not in held:
                    continue
                params = dict(output.kv_transfer_params or {})
                params.setdefault(OMNI_KEY, {}).update(held.pop(output.request_id))
                output.kv_transfer_params = params
        for req_id in [rid for rid in held if rid not in self.requests]:
            # finished without an output to carry them (aborted): a connector lease frees their payloads
            del held[req_id]

    def _run_hooks(
        self,
        outputs: dict[int, EngineCoreOutputs],
        prefilling: list[Request],
        watched: dict[str, Request | None],
    ) -> None:
        for request in prefilling:
            self.on_prefill_finished(request)
        triggers = self._omni_triggers
        if not triggers:
            return
        for bucket in outputs.values():
            for output in bucket.outputs:
                wanted = triggers.get(output.request_id)
                if wanted is None:
                    continue
                request = watched.get(output.request_id)
                for token_id in output.new_token_ids:
                    if token_id in wanted:
                        self.on_trigger_token(request, token_id)
                if output.finish_reason is not None:
                    triggers.pop(output.request_id, None)


@functools.cache
def _cached_data_parameters(cls: type) -> inspect.Signature:
    """The signature of the vLLM base's ``_make_cached_request_data`` below ``cls``'s mixin."""
    mro = cls.__mro__
    return inspect.signature(mro[mro.index(OmniARSchedulerMixin) + 1]._make_cached_request_data)


class OmniARScheduler(OmniARSchedulerMixin, Scheduler):
    pass


class OmniARAsyncScheduler(OmniARSchedulerMixin, AsyncScheduler):
    pass
