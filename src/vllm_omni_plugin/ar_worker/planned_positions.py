"""Planned M-RoPE positions on vLLM's V2 model runner (``vllm/v1/worker/gpu/``).

GLM-Image positions its generated tokens on 2-D grids (``models/glm_image_ar.py``): the model's
``get_mrope_input_positions`` returns the prompt's positions followed by the whole decode plan. The V1
runner takes them through ``OmniModelRunnerMixin._calc_mrope_positions``; V2 keeps positions in its
``RopeState`` and gives every token after the prefill ``num_computed + delta`` (linear), so without this
module the plan is silently ignored there. V2's per-model seam is ``model.get_model_state_cls()``:
:class:`PlannedMRopeModelState` is vLLM's ``DefaultModelState`` whose table holds the whole plan (clipped
to the table's width, ``max_model_len``) and whose positions come from
:func:`~vllm_omni_plugin.ar_worker.planned_mrope.planned_mrope_positions` (plain torch, in a module of its
own so that it runs, and is checked inside a CUDA graph, where vLLM is not installed).

Only V2 imports this module (through the model's ``get_model_state_cls``); the V1 runner and the CPU
platform never do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_omni_plugin.ar_worker.planned_mrope import planned_mrope_positions
from vllm_omni_plugin.ar_worker.stage_outbox import record_model_stage_outputs
from vllm_omni_plugin.compat import resolve

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache
    from vllm.v1.worker.gpu.states import RequestState

DefaultModelState = resolve("DefaultModelState")
UvaBackedTensor = resolve("UvaBackedTensor")


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
        # V2's one seam that sees a new request with its features and the model: the model's outputs for
        # the next stage (the plugin's KV connector carries them; a resumed request, re-sent whole, asks
        # again and the scheduler keeps one copy)
        record_model_stage_outputs(self.model, new_req_data.req_id, new_req_data.mm_features)
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
