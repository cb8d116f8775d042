"""Planned M-RoPE positions on vLLM's V2 model runner (``vllm/v1/worker/gpu/``).

GLM-Image positions its generated tokens on 2-D grids (``models/glm_image_ar.py``): the model's
``get_mrope_input_positions`` returns the prompt's positions followed by the whole decode plan. The V1
runner takes them through ``OmniModelRunnerMixin._calc_mrope_positions``; V2 keeps positions in its
``RopeState`` and gives every token after the prefill ``num_computed + delta`` (linear), so without this
module the plan is silently ignored there. V2's per-model seam is ``model.get_model_state_cls()``:
:class:`PlannedMRopeModelState` is vLLM's ``DefaultModelState`` whose table holds the whole plan (clipped
to the table's width, ``max_model_len``) and whose positions come from :func:`planned_mrope_positions`.

Only V2 imports this module (through the model's ``get_model_state_cls``); the V1 runner and the CPU
platform never do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_omni_plugin.compat import resolve

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache
    from vllm.v1.worker.gpu.states import RequestState

DefaultModelState = resolve("DefaultModelState")
UvaBackedTensor = resolve("UvaBackedTensor")


def planned_mrope_positions(
    plans: torch.Tensor,
    planned_lens: torch.Tensor,
    deltas: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    num_tokens: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """M-RoPE positions ``[num_dims, num_tokens]`` (int64) of a batch's scheduled tokens.

    The token at sequence index ``p = num_computed_tokens[slot] + offset`` of request slot ``slot`` gets
    ``plans[slot, :, p]`` while ``p < planned_lens[slot]``, else ``p + deltas[slot]`` on every axis.

    - ``plans`` ``[num_slots, num_dims, width]``: the planned positions per request slot;
    - ``planned_lens``, ``deltas``, ``num_computed_tokens`` ``[num_slots]``;
    - ``idx_mapping`` ``[num_reqs]``: batch row -> request slot (int32 or int64);
    - ``query_start_loc`` ``[>= num_reqs + 1]``: the rows' token offsets (entries past ``num_reqs`` are
      padding and ignored);
    - ``out`` ``[num_dims, >= num_tokens]``: written in place when given (the runner's persistent
      buffer); tokens past ``num_tokens`` are left as they are.

    Runs on the device every step, so it reads no tensor value on the host: only ``num_tokens`` (which
    the runner knows on the host) and shapes decide the work.
    """
    num_reqs = idx_mapping.shape[0]
    num_dims = plans.shape[1]
    device = plans.device
    if num_tokens == 0 or num_reqs == 0:
        result = torch.empty((num_dims, 0), dtype=torch.int64, device=device)
        return result if out is None else out[:, :0]
    token = torch.arange(num_tokens, dtype=torch.int64, device=device)
    starts = query_start_loc[: num_reqs + 1].to(torch.int64)
    row = torch.searchsorted(starts[1:], token, right=True).clamp_(max=num_reqs - 1)
    slot = idx_mapping.to(torch.int64)[row]
    pos = num_computed_tokens.to(torch.int64)[slot] + (token - starts[row])
    planned = plans[slot, :, pos.clamp(0, plans.shape[2] - 1)].T.to(torch.int64)
    in_plan = pos < planned_lens.to(torch.int64)[slot]
    linear = pos + deltas.to(torch.int64)[slot]
    result = torch.where(in_plan, planned, linear)
    if out is None:
        return result
    target = out[:, :num_tokens]
    target.copy_(result)
    return target


class PlannedMRopeModelState(DefaultModelState):
    """V2 model state for models whose ``get_mrope_input_positions`` plans generated tokens too.

    ``add_request`` writes the whole plan (prompt + decode positions, clipped to the table's width) into
    ``RopeState``'s table and records its length per request slot; ``prepare_inputs`` takes positions from
    the plan while a token is inside it, else ``p + delta`` as vLLM does. Everything else is vLLM's
    ``DefaultModelState``. Without the clip vLLM's staged write would run past the row into the next
    request's plan (its write kernel does not bound a write by the row's width).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        model: torch.nn.Module,
        encoder_cache: EncoderCache | None,
        device: torch.device,
    ) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.planned_len = UvaBackedTensor(self.max_num_reqs, dtype=torch.int32)
        """Length of each request slot's plan in the table (positions past it are linear)."""

    def add_request(self, req_index: int, new_req_data: NewRequestData) -> None:
        rope = self.rope_state
        if rope is None:
            super().add_request(req_index, new_req_data)
            return
        assert new_req_data.prefill_token_ids is not None
        # As DefaultModelState: prompt_embeds is a passthrough modality without grids.
        mm_features = [f for f in new_req_data.mm_features if f.modality != "prompt_embeds"]
        positions, delta = self.model.get_mrope_input_positions(new_req_data.prefill_token_ids, mm_features)
        plan = torch.as_tensor(positions)[:, : rope.max_model_len]
        for dim in range(rope.num_dims):
            rope.prefill_positions.stage_write(rope.num_dims * req_index + dim, 0, plan[dim].tolist())
        rope.prefill_delta.np[req_index] = delta
        self.planned_len.np[req_index] = plan.shape[1]
        # The rest of DefaultModelState.add_request, without its own (unclipped) write of the positions.
        self.rope_state = None
        try:
            super().add_request(req_index, new_req_data)
        finally:
            self.rope_state = rope

    def apply_staged_writes(self) -> None:
        super().apply_staged_writes()
        self.planned_len.copy_to_uva()

    def prepare_inputs(self, input_batch: InputBatch, req_states: RequestState) -> dict[str, Any]:
        rope = self.rope_state
        if rope is None:
            return super().prepare_inputs(input_batch, req_states)
        planned_mrope_positions(
            rope.prefill_positions.gpu.view(rope.max_num_reqs, rope.num_dims, rope.max_model_len),
            self.planned_len.gpu,
            rope.prefill_delta.gpu,
            input_batch.idx_mapping,
            input_batch.query_start_loc,
            req_states.num_computed_tokens.gpu,
            input_batch.num_tokens,
            out=rope.positions,
        )
        return {"positions": rope.get_positions(input_batch.num_tokens_after_padding)}
