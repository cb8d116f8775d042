"""``OmniModelRunnerMixin``: what an omni AR stage needs from vLLM's V1 model runner, as small hooks.

- **Safe resume.** Under async scheduling vLLM's ``_update_states`` rebuilds a request that left the
  persistent batch (resumed after preemption, or not scheduled last step) from
  ``CachedRequestData.all_token_ids[req_id]``, and raises ``KeyError`` when the scheduler did not fill
  it: the engine core dies (the production crash told in ``docs/architecture.md``). A pre-pass at the
  start of ``execute_model`` fills any missing entry from the runner's own request state; a request it
  cannot rebuild is left out of the step (the whole step sees a scheduler output without it) and the
  Omni scheduler finishes it with an error, so the engine keeps serving everyone else. Under async
  scheduling the runner records each sampled token as a ``-1`` placeholder (``output_token_ids`` and
  ``input_batch.token_ids_cpu``, flagged as token ids) until the next step writes the real id on the
  device, so a placeholder is never taken for a token.
- **Precomputed decode positions.** M-RoPE models whose generated tokens have 2-D grid positions
  (GLM-Image) return them from ``get_mrope_input_positions`` after the prompt's; stock vLLM gives
  generated tokens ``delta + context_len`` on every axis. After vLLM's own computation we copy the
  planned positions in wherever a request has them. (V2 runner: ``ar_worker/planned_positions.py``.)
- **Stage outputs and dropped requests.** Per-request outputs for the next stage recorded with
  ``set_stage_output`` (or computed by the model, ``omni_stage_outputs(mm_features)``), and the requests
  the resume pre-pass left out, travel on the step's ``ModelRunnerOutput`` as an ``OmniRunnerOutput``
  (``vllm_omni_plugin.ar_channel``), which the Omni scheduler reads. (Context exports of KV-handoff
  pipelines travel through the KV connector of ``ar_worker/context_export.py`` on either runner.)
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from vllm_omni_plugin.ar_channel import RUNNER_OUTPUT_ATTR, OmniRunnerOutput
from vllm_omni_plugin.ar_worker.stage_outbox import STAGE_OUTBOX, record_model_stage_outputs
from vllm_omni_plugin.compat import runner_output_payload
from vllm_omni_plugin.log import get_logger

if TYPE_CHECKING:
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

logger = get_logger(__name__)

V1_ONLY = True
"""Read by the release check: the mixin is used only where vLLM runs its V1 runner (``v1_*_runner.py``)."""


class OmniModelRunnerMixin:
    """Mixed in front of ``GPUModelRunner`` or ``CPUModelRunner``."""

    requests: dict[str, CachedRequestState]
    input_batch: InputBatch
    use_async_scheduling: bool
    mrope_positions: CpuGpuBuffer
    vllm_config: VllmConfig
    compilation_config: CompilationConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._omni_dropped: list[str] = []
        """Requests the resume pre-pass left out of the current step."""

    # --- what the step's output carries ---

    def set_stage_output(self, req_id: str, key: str, value: Any) -> None:
        """Record a per-request output of this stage (msgpack-serialisable) for the request's output
        (held in the worker's ``STAGE_OUTBOX`` until a step that ran the request carries it)."""
        STAGE_OUTBOX.record(req_id, {key: value})

    def execute_model(self, scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any) -> Any:
        output = super().execute_model(self._omni_resume_prepass(scheduler_output), *args, **kwargs)
        if output is None:  # the step's output comes from sample_tokens
            return output
        payload = runner_output_payload(output)
        if payload is not None and self._omni_dropped:
            # A step with nothing left to run returns vLLM's shared empty output: attach to a copy.
            payload = copy.copy(payload)
            self._attach_omni_output(payload)
            return payload
        return output

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        output = super().sample_tokens(*args, **kwargs)
        payload = runner_output_payload(output)
        if payload is not None:
            self._attach_omni_output(payload)
        return output

    def _attach_omni_output(self, payload: ModelRunnerOutput) -> None:
        """Put this step's stage outputs and dropped requests on its ``ModelRunnerOutput``."""
        ran = getattr(payload, "req_id_to_index", None)
        if ran is None:  # not a step's output (e.g. pipeline-parallel intermediate tensors)
            return
        ready = STAGE_OUTBOX.take(ran)
        dropped, self._omni_dropped = self._omni_dropped, []
        if ready or dropped:
            setattr(
                payload, RUNNER_OUTPUT_ATTR, OmniRunnerOutput(stage_outputs=ready, dropped_req_ids=dropped)
            )

    # --- safe resume ---

    def _rebuild_token_ids(self, req_id: str, num_output_tokens: int) -> list[int] | None:
        """prompt + the first ``num_output_tokens`` outputs of a request, from the runner's own state."""
        state = self.requests.get(req_id)
        if state is None or state.prompt_token_ids is None:
            return None
        prompt = list(state.prompt_token_ids)
        outputs = list(state.output_token_ids[:num_output_tokens])
        if len(outputs) == num_output_tokens and -1 not in outputs:
            return prompt + outputs
        # Async placeholders (-1): the real ids may still sit in the persistent batch's token buffer,
        # which holds -1 too (flagged as token ids) for tokens whose real id only the device has.
        row = self.input_batch.req_id_to_index.get(req_id)
        if row is None:
            return None
        start, end = len(prompt), len(prompt) + num_output_tokens
        if not self.input_batch.is_token_ids[row, start:end].all():
            return None
        tokens = [int(t) for t in self.input_batch.token_ids_cpu[row, start:end]]
        return None if -1 in tokens else prompt + tokens

    def _omni_resume_prepass(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        cached = scheduler_output.scheduled_cached_reqs
        if not self.use_async_scheduling or not cached.req_ids:
            return scheduler_output
        unrecoverable: list[int] = []
        for index, req_id in enumerate(cached.req_ids):
            num_output_tokens = cached.num_output_tokens[index]
            rebuilt = req_id in cached.resumed_req_ids or req_id not in self.input_batch.req_id_to_index
            if not rebuilt or num_output_tokens <= 0 or req_id in cached.all_token_ids:
                continue
            token_ids = self._rebuild_token_ids(req_id, num_output_tokens)
            if token_ids is None:
                unrecoverable.append(index)
            else:
                logger.warning(
                    "request %s resumed without all_token_ids from the scheduler; rebuilt its %d "
                    "tokens from the runner's state",
                    req_id,
                    len(token_ids),
                )
                cached.all_token_ids[req_id] = token_ids
        if not unrecoverable:
            return scheduler_output
        return self._drop_requests(scheduler_output, unrecoverable)

    def _drop_requests(self, scheduler_output: SchedulerOutput, indices: list[int]) -> SchedulerOutput:
        """A copy of this step's scheduler output without the requests at ``indices`` of the cached
        list. The scheduler's own object is left alone (in-process executors share it)."""
        out = copy.copy(scheduler_output)
        cached = copy.copy(scheduler_output.scheduled_cached_reqs)
        drop = set(indices)
        dropped = [cached.req_ids[i] for i in indices]
        keep = [i for i in range(len(cached.req_ids)) if i not in drop]
        cached.req_ids = [cached.req_ids[i] for i in keep]
        cached.new_block_ids = [cached.new_block_ids[i] for i in keep]
        cached.num_computed_tokens = [cached.num_computed_tokens[i] for i in keep]
        cached.num_output_tokens = [cached.num_output_tokens[i] for i in keep]
        if cached.new_token_ids:
            cached.new_token_ids = [cached.new_token_ids[i] for i in keep]
        cached.resumed_req_ids = set(cached.resumed_req_ids) - set(dropped)
        out.scheduled_cached_reqs = cached
        num_scheduled = dict(scheduler_output.num_scheduled_tokens)
        removed = sum(num_scheduled.pop(rid, 0) for rid in dropped)
        out.num_scheduled_tokens = num_scheduled
        out.total_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens - removed
        out.scheduled_spec_decode_tokens = {
            k: v for k, v in scheduler_output.scheduled_spec_decode_tokens.items() if k not in dropped
        }
        out.scheduled_encoder_inputs = {
            k: v for k, v in scheduler_output.scheduled_encoder_inputs.items() if k not in dropped
        }
        self._omni_dropped.extend(dropped)
        for rid in dropped:
            logger.error(
                "request %s must be rebuilt but neither the scheduler nor the runner has its tokens; "
                "it is failed, the engine keeps serving",
                rid,
            )
        return out

    def _update_states(self, scheduler_output: SchedulerOutput) -> Any:
        result = super()._update_states(scheduler_output)
        self._collect_model_stage_outputs(scheduler_output)
        return result

    def _collect_model_stage_outputs(self, scheduler_output: SchedulerOutput) -> None:
        """Models with per-request outputs for the next stage (``omni_stage_outputs(mm_features)``)
        are asked once, when the request arrives."""
        model = getattr(self, "model", None)
        for new in scheduler_output.scheduled_new_reqs:
            record_model_stage_outputs(model, new.req_id, new.mm_features)

    # --- precomputed decode positions ---

    def _calc_mrope_positions(self, scheduler_output: SchedulerOutput) -> None:
        super()._calc_mrope_positions(scheduler_output)
        ptr = 0
        batch = self.input_batch
        for index, req_id in enumerate(batch.req_ids):
            req = self.requests[req_id]
            computed = int(batch.num_computed_tokens_cpu[index])
            scheduled = scheduler_output.num_scheduled_tokens[req_id]
            num_prompt = req.num_prompt_tokens
            prompt_part = max(0, min(scheduled, num_prompt - computed))
            completion = scheduled - prompt_part
            planned = req.mrope_positions
            if completion > 0 and planned is not None:
                context = computed + prompt_part
                available = max(0, min(completion, planned.shape[1] - context))
                if available > 0:
                    dst = ptr + prompt_part
                    self.mrope_positions.cpu[:, dst : dst + available] = planned[
                        :, context : context + available
                    ]
            ptr += scheduled
