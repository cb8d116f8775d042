"""GLM-Image's 2-D decode positions on vLLM's V2 model runner (``ar_worker/planned_positions.py``), step by
step against the V1 path (``OmniModelRunnerMixin._calc_mrope_positions``) for the same batches.

What runs, and why not more:

- This module checks the pieces step by step against V1 with scenarios a served run cannot force (chunked
  prefills ending inside the prompt, a clipped plan, a reused slot, a resume mid-decode);
  ``tests/test_v2_runner_on_cpu.py`` runs V2's whole runner end to end (Triton's kernels in its
  interpreter, test-only).
- ``PlannedMRopeModelState`` (with its ``RopeState``) is built through vLLM's own factory
  (``init_model_state``, which asks the model's ``get_model_state_cls``), on CPU. That works only in a
  process that imported vLLM's CPU-worker shim ``vllm.v1.worker.cpu.shm`` (every vLLM CPU worker does,
  through ``cpu_worker``): V2's buffers are pinned host memory (``UvaBuffer``:
  ``torch.zeros(..., pin_memory=True)``), which a CPU build of torch cannot allocate, and the shim swaps in
  a plain CPU buffer. It patches torch for its whole process, so the class runs in the engine script
  (``engine_scripts/glm_image_v2_positions.py``), not in pytest's process (the script records the error
  without the shim, and a test checks it).
- Of the class, only Triton does not run: the staged writes of the plan table and of the request state
  (``StagedWriteTensor.apply_write``) are applied by the same writes in torch, flat as the kernel writes
  them, and V2's device-side advance of ``num_computed_tokens`` is a torch add. ``add_request``,
  ``apply_staged_writes`` and ``prepare_inputs`` (with the pure function) are the real ones, with vLLM's
  ``RequestState`` and ``InputBatch``.
- The V1 side is the real ``OmniCPUModelRunner`` with the tiny model loaded, driven by
  ``SchedulerOutput``s without an engine (``_update_states``, ``_calc_mrope_positions``).
- Each step is also checked against the plan itself (``get_mrope_input_positions`` of the prompt: the plan
  while a token is inside it, its index after), so the comparison cannot pass with both sides linear.
- The pure function runs here directly, also on the meta device, where any host read of a tensor value
  (``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero``, boolean-mask indexing, ``repeat_interleave``
  without ``output_size``) raises: what runs there cannot make a GPU wait for its host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import ENGINE_SCRIPTS, run_result_script

SCRIPT = ENGINE_SCRIPTS / "glm_image_v2_positions.py"
MAX_MODEL_LEN = 280
"""As in the script."""
SCENARIOS = ("t2i_both_grids", "i2i_sources_chunked", "batch_clipped_and_reused_slot", "resumed_mid_decode")


# --- the pure function --------------------------------------------------------------------------------


def reference_positions(
    plans: torch.Tensor,
    planned_lens: torch.Tensor,
    deltas: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed: torch.Tensor,
) -> torch.Tensor:
    """The rule, one token at a time."""
    columns = []
    for row, slot in enumerate(idx_mapping.tolist()):
        for offset in range(int(query_start_loc[row + 1] - query_start_loc[row])):
            p = int(num_computed[slot]) + offset
            if p < int(planned_lens[slot]):
                columns.append([int(v) for v in plans[slot, :, p]])
            else:
                columns.append([p + int(deltas[slot])] * plans.shape[1])
    return torch.tensor(columns, dtype=torch.int64).T.reshape(plans.shape[1], -1)


def random_batch(seed: int, idx_dtype: torch.dtype) -> dict[str, Any]:
    """Six slots (one with an empty plan), four scheduled rows in another order than their slots, tokens on
    both sides of each plan's end, ``query_start_loc`` padded past the rows as the V2 runner pads it."""
    g = torch.Generator().manual_seed(seed)
    num_slots, num_dims, width = 6, 3, 48
    plans = torch.randint(0, 10_000, (num_slots, num_dims, width), generator=g, dtype=torch.int32)
    planned_lens = torch.tensor([48, 20, 0, 31, 5, 40], dtype=torch.int32)
    deltas = torch.tensor([0, -4, 9, 3, 0, 0], dtype=torch.int32)
    num_computed = torch.tensor([2, 17, 6, 0, 5, 39], dtype=torch.int32)
    idx_mapping = torch.tensor([3, 1, 2, 5], dtype=idx_dtype)
    counts = [31, 6, 3, 4]  # slot 3: prefill through its plan; 1 and 5: across their plan's end
    query_start_loc = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist(), 44, 44], dtype=torch.int32)
    return {
        "plans": plans,
        "planned_lens": planned_lens,
        "deltas": deltas,
        "idx_mapping": idx_mapping,
        "query_start_loc": query_start_loc,
        "num_computed_tokens": num_computed,
        "num_tokens": sum(counts),
    }


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])  # vLLM 0.31 / 0.32+
def test_positions_follow_the_plan_then_run_on(idx_dtype: torch.dtype) -> None:
    from vllm_omni_plugin.ar_worker.planned_mrope import planned_mrope_positions

    batch = random_batch(0, idx_dtype)
    got = planned_mrope_positions(**batch)
    expected = reference_positions(
        batch["plans"],
        batch["planned_lens"],
        batch["deltas"],
        batch["idx_mapping"],
        batch["query_start_loc"],
        batch["num_computed_tokens"],
    )
    assert got.dtype == torch.int64 and got.shape == (3, batch["num_tokens"])
    assert torch.equal(got, expected)
    # both rules, by hand: slot 1 (row 1) computes 17..22, planned up to 20, then p - 4
    assert torch.equal(got[:, 31:34], batch["plans"][1, :, 17:20].long())
    assert torch.equal(got[:, 34:37], torch.tensor([[16, 17, 18]] * 3))
    assert torch.equal(got[:, 37:40], torch.tensor([[15, 16, 17]] * 3))  # slot 2: no plan, p + 9


def test_positions_go_into_the_runners_buffer() -> None:
    from vllm_omni_plugin.ar_worker.planned_mrope import planned_mrope_positions

    batch = random_batch(1, torch.int64)
    buffer = torch.full((3, 65), -7, dtype=torch.int64)  # the runner's buffer: max_num_tokens + 1 wide
    view = planned_mrope_positions(**batch, out=buffer)
    assert view.data_ptr() == buffer.data_ptr() and view.shape == (3, batch["num_tokens"])
    assert torch.equal(buffer[:, : batch["num_tokens"]], planned_mrope_positions(**batch))
    assert (buffer[:, batch["num_tokens"] :] == -7).all()  # padding tokens are left as they are
    empty = planned_mrope_positions(**{**batch, "num_tokens": 0}, out=buffer)
    assert empty.shape == (3, 0)


def test_positions_read_no_device_value_on_the_host() -> None:
    """On the meta device every host read of a tensor's value raises, so the function would too."""
    from vllm_omni_plugin.ar_worker.planned_mrope import planned_mrope_positions

    batch = random_batch(2, torch.int64)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    out = torch.empty((3, 65), dtype=torch.int64, device="meta")
    got = planned_mrope_positions(**meta, out=out)
    assert got.device.type == "meta" and got.shape == (3, batch["num_tokens"])
    probe = torch.ones(4, dtype=torch.int64, device="meta")
    for host_read in (lambda t: t.item(), lambda t: t.tolist(), lambda t: t.cpu(), lambda t: t.nonzero()):
        with pytest.raises((RuntimeError, NotImplementedError)):  # the probe itself can fail
            host_read(probe)


@pytest.mark.cuda
def test_positions_are_captured_in_a_cuda_graph() -> None:
    """On the device the function runs inside a CUDA graph (a host read would fail the capture), and a
    replay over new inputs written in place gives what the CPU gives."""
    from vllm_omni_plugin.ar_worker.planned_mrope import planned_mrope_positions

    first, second = random_batch(3, torch.int64), random_batch(4, torch.int64)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in first.items()}
    out = torch.zeros((3, 65), dtype=torch.int64, device="cuda")
    planned_mrope_positions(**inputs, out=out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        planned_mrope_positions(**inputs, out=out)
    for name, value in second.items():
        if isinstance(value, torch.Tensor):
            inputs[name].copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:, : second["num_tokens"]].cpu(), planned_mrope_positions(**second))


# --- V2's model state against the V1 runner -----------------------------------------------------------


@pytest.fixture(scope="module")
def run(tiny_glm_image: Path) -> dict[str, Any]:
    return run_result_script(SCRIPT, str(tiny_glm_image))


def checked_scenario(run: dict[str, Any], name: str) -> dict[str, list[int]]:
    """Every step of scenario ``name``: V2 == V1 == the plan (or the index past it); returns the sequence
    indices each request computed."""
    data = run[name]
    assert "error" not in data, data.get("trace")
    covered: dict[str, list[int]] = {}
    for number, step in enumerate(data["steps"]):
        assert set(step["v1"]) == set(step["v2"]) == set(step["start"]), number
        for rid, start in step["start"].items():
            v1, v2 = step["v1"][rid], step["v2"][rid]
            assert v2 == v1, f"{name} step {number} request {rid} from {start}: V2 {v2} != V1 {v1}"
            plan = run["plans"][data["cases"][rid]]
            planned = min(len(plan[0]), MAX_MODEL_LEN)
            for j in range(len(v2[0])):
                p = start + j
                want = [row[p] for row in plan] if p < planned else [p, p, p]
                assert [row[j] for row in v2] == want, f"{name} step {number} request {rid} at {p}"
            covered.setdefault(rid, []).extend(range(start, start + len(v2[0])))
    return covered


def starts_of(run: dict[str, Any], name: str, rid: str) -> list[tuple[int, int]]:
    """(first index, token count) of each step that ran ``rid``."""
    return [
        (step["start"][rid], len(step["v2"][rid][0])) for step in run[name]["steps"] if rid in step["start"]
    ]


def test_t2i_both_grids_then_past_the_plan(run: dict[str, Any]) -> None:
    covered = checked_scenario(run, "t2i_both_grids")
    plan = run["plans"]["t2i_64"]
    prompt_len = run["prompt_lens"]["t2i_64"]
    assert len(plan[0]) == prompt_len + 16 * 16 + 2 * 2 + 1
    assert covered["a"] == list(range(MAX_MODEL_LEN - 1))  # prompt, both grids, end marker, beyond
    decode = range(prompt_len, len(plan[0]))
    assert any(plan[1][p] != plan[2][p] for p in decode)  # 2-D: what V2 alone would not give


def test_i2i_source_grids_and_a_prefill_chunk_ending_inside_the_prompt(run: dict[str, Any]) -> None:
    covered = checked_scenario(run, "i2i_sources_chunked")
    first, count = starts_of(run, "i2i_sources_chunked", "b")[0]
    assert first == 0 and count < run["prompt_lens"]["i2i_100"]
    for rid, case in (("a", "i2i_64"), ("b", "i2i_100")):
        plan = run["plans"][case]
        assert max(covered[rid]) >= len(plan[0])  # decoded past the plan
        assert any(plan[1][p] != plan[2][p] for p in range(run["prompt_lens"][case]))  # the source grid


def test_v2_hands_the_same_source_image_outputs_as_v1(run: dict[str, Any]) -> None:
    """Image-to-image on V2: the model state records, for each new request, what the V1 runner records
    (the source images' VQ ids and grids, which the KV connector's worker metadata carries
    to the scheduler on V2); text-to-image requests record nothing; a request V2 re-adds whole after a
    preemption records the same again (the scheduler keeps one copy)."""
    seen = 0
    for name in SCENARIOS:
        data = run[name]
        assert "error" not in data, data.get("trace")
        v1, v2 = data["handed"]["v1"], data["handed"]["v2"]
        i2i = sorted(rid for rid, case in data["cases"].items() if case.startswith("i2i"))
        assert sorted(v1) == sorted(v2) == i2i, name
        for rid in i2i:
            assert len(v1[rid]) == 1 and v2[rid][0] == v1[rid][0], (name, rid)
            assert all(again == v1[rid][0] for again in v2[rid]), (name, rid)
            (ids,) = v1[rid][0]["source_token_ids"]
            (grid,) = v1[rid][0]["source_grids"]
            assert grid[0] == 1 and len(ids) == grid[1] * grid[2]  # the d32 grid, one id per cell
            seen += 1
    assert seen >= 4
    assert len(run["resumed_mid_decode"]["handed"]["v2"]["b"]) == 2  # b is preempted and re-added


def test_batch_with_a_clipped_plan_and_a_reused_slot(run: dict[str, Any]) -> None:
    covered = checked_scenario(run, "batch_clipped_and_reused_slot")
    data = run["batch_clipped_and_reused_slot"]
    assert len(data["steps"][0]["start"]) == 3
    assert len(run["plans"]["t2i_128"][0]) > MAX_MODEL_LEN  # clipped to the table
    assert max(covered["t128"]) == MAX_MODEL_LEN - 2
    slots = data["slots"]
    # the long plan was written in the same step as the prefill of the slot after it (which an unclipped
    # write runs into), and i2i_64's shorter plan went into i2i_100's slot once it finished
    assert slots["t64"][0] == slots["t128"][0] + 1
    assert slots["i64"] == slots["i100"]
    assert max(covered["i64"]) >= len(run["plans"]["i2i_64"][0])


def test_resumed_mid_decode(run: dict[str, Any]) -> None:
    checked_scenario(run, "resumed_mid_decode")
    data = run["resumed_mid_decode"]
    a, b = starts_of(run, "resumed_mid_decode", "a"), starts_of(run, "resumed_mid_decode", "b")
    prompt_a, prompt_b = run["prompt_lens"]["t2i_64"], run["prompt_lens"]["i2i_100"]
    resumed_a = next(i for i, (start, _) in enumerate(a) if i > 0 and start == 0)
    first, count = a[resumed_a]
    assert count < prompt_a  # the first chunk after the resume ends inside the prompt ...
    start, count = a[resumed_a + 1]
    assert start < prompt_a < start + count  # ... the second spans its end into the generated tokens
    start, count = next((s, n) for s, n in b if s == 16)  # prefix-cache hit: one chunk over the end
    assert start < prompt_b < start + count
    assert data["slots"]["a"][0] != data["slots"]["a"][1]  # re-added in another slot, as V2 does


def test_v2_hook_builds_the_planned_state_and_v1_never_loads_it(run: dict[str, Any]) -> None:
    assert run["state_cls"] == "vllm_omni_plugin.ar_worker.planned_positions.PlannedMRopeModelState"
    assert run["loaded_by_v1"] == {
        "vllm_omni_plugin.ar_worker.planned_positions": False,
        "vllm.v1.worker.gpu.model_states.default": False,
    }
    # built on CPU on the CPU worker's buffers (the scenarios ran it), which it needs: without vLLM's
    # CPU-worker shim V2's pinned buffers cannot be allocated (why it runs in the engine script)
    assert all("error" not in run[name] for name in SCENARIOS)
    assert "pin_memory" in (run["rope_state_without_cpu_shim"] or "")
