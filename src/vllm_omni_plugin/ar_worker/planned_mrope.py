"""The planned M-RoPE positions of a batch's scheduled tokens, computed on the device with no host read:
the function V2's model state (``planned_positions.PlannedMRopeModelState``) calls every step. Plain torch,
so that it imports (and its CUDA-graph check runs) without vLLM."""

from __future__ import annotations

import torch


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
