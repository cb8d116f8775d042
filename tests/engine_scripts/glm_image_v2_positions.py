"""GLM-Image's positions on vLLM's V1 runner (the real ``OmniCPUModelRunner``) and through V2's model-state
hook (``PlannedMRopeModelState``), step by step for the same scheduled batches.

Each scenario is a list of steps (which requests run, how many tokens each, which are preempted or
resumed, which finish). The V1 side gets them as ``SchedulerOutput``s through ``_update_states`` and
``_calc_mrope_positions``; the V2 side as the V2 runner passes them on: ``RequestState.add_request`` and
``ModelState.add_request`` for new and resumed requests (V2 re-adds a resumed request with its prompt and
outputs as ``prefill_token_ids``), then ``apply_staged_writes``, then ``prepare_inputs`` with an
``InputBatch`` whose ``idx_mapping`` / ``query_start_loc`` / ``num_tokens`` are laid out as
``GPUModelRunner.prepare_inputs`` lays them out (``query_start_loc`` padded, ``num_tokens_after_padding``
rounded up as for a CUDA graph).

What of V2 cannot run on this CPU build, and what stands in for it (tests/test_glm_image_v2_positions.py
says why):

- V2's buffers are pinned host memory (``UvaBuffer``: ``torch.zeros(..., pin_memory=True)``), which a CPU
  build of torch cannot allocate. vLLM's CPU worker imports ``vllm.v1.worker.cpu.shm``, which swaps in a
  plain CPU ``UvaBuffer`` (and makes ``pin_memory`` a no-op) for V2 on CPU; this process imports it too
  (as every vLLM CPU worker process does), after recording what building a
  ``RopeState`` does without it.
- ``StagedWriteTensor.apply_write`` launches a Triton kernel, and Triton has no CPU backend: it is
  replaced by ``apply_write_on_cpu``, the same writes in torch (flat, as the kernel writes them: a write
  longer than its row runs into the next row, which is what the plan's clip prevents).
- V2 advances ``num_computed_tokens`` on the device after each step (another Triton kernel); here by a
  torch add of the step's query lengths.

Prints one JSON line ``RESULT {...}``. Run as a script: it initialises vLLM's distributed state.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from one_process import TINY_ENGINE_ARGS, engine_config, loaded_runner, one_process

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (helpers)

MAX_MODEL_LEN = 280
"""t2i 64x64 (14 + 261) fits; t2i 128x128 (14 + 273) does not: its plan is clipped."""
MAX_NUM_SEQS = 8
BLOCK_SIZE = 16
ARCH = "GlmImageForConditionalGeneration"
MODEL_CLASS = "vllm_omni_plugin.models.glm_image_ar:GlmImageForConditionalGeneration"

# name -> (source image side or None, target height, target width)
CASES: dict[str, tuple[int | None, int, int]] = {
    "t2i_64": (None, 64, 64),
    "t2i_128": (None, 128, 128),
    "i2i_64": (64, 64, 64),
    "i2i_100": (100, 64, 64),
}

# Scenarios: request id -> (case, max_tokens); steps: {"run": {rid: tokens or "rest"}, "preempt": [...],
# "resume": {rid: num_computed_tokens}}; "rest" schedules all of a request's tokens not computed yet, and
# "run": "decode" one token of every running request. A request finishes once it has max_tokens outputs or
# fills max_model_len, as vLLM's scheduler finishes it. Prompts: t2i 14 tokens, i2i_64 17 (source image
# run 1..4), i2i_100 22 (source run 1..9).
SCENARIOS: dict[str, dict[str, Any]] = {
    # the first grid, the second, the end marker, then past the plan up to max_model_len
    "t2i_both_grids": {
        "requests": {"a": ("t2i_64", 10_000)},
        "steps": [{"run": {"a": "rest"}}, *[{"run": "decode"}] * 300],
    },
    # source grids; a chunked prefill that ends inside the prompt (inside the 3x3 source run); past the plan
    "i2i_sources_chunked": {
        "requests": {"a": ("i2i_64", 12), "b": ("i2i_100", 12)},
        "steps": [{"run": {"a": "rest", "b": 6}}, {"run": {"a": 1, "b": "rest"}}, *[{"run": "decode"}] * 20],
    },
    # several requests in one batch; a plan longer than max_model_len (t2i_128, clipped) added in the same
    # step as its neighbour slot's prefill; a finished request's slot reused by a shorter plan
    "batch_clipped_and_reused_slot": {
        "requests": {
            "t64": ("t2i_64", 10_000),
            "t128": ("t2i_128", 10_000),
            "i100": ("i2i_100", 10),
            "i64": ("i2i_64", 12),
        },
        "steps": [
            {"run": {"t64": "rest", "t128": "rest", "i100": "rest"}},
            *[{"run": "decode"}] * 10,
            {"run": {"t64": 1, "t128": 1, "i64": "rest"}},  # i100 has finished: i64 takes its slot
            *[{"run": "decode"}] * 300,
        ],
    },
    # resumed mid-decode: recomputed from 0 in two chunks, the first ending inside the prompt and the second
    # spanning the prompt's end; and resumed with a prefix-cache hit whose one chunk spans the prompt's end
    "resumed_mid_decode": {
        "requests": {"a": ("t2i_64", 10_000), "b": ("i2i_100", 30)},
        "steps": [
            {"run": {"a": "rest", "b": "rest"}},
            *[{"run": "decode"}] * 20,
            {"preempt": ["a", "b"], "run": {}},
            {"resume": {"a": 0, "b": 16}, "run": {"a": 8, "b": "rest"}},
            {"run": {"a": "rest", "b": 1}},
            *[{"run": "decode"}] * 300,
        ],
    },
}


def apply_write_on_cpu(self: Any) -> None:
    """``StagedWriteTensor.apply_write`` without its Triton kernel: each staged write copies its contents
    to ``row * row_stride + start`` of the flat tensor, unbounded by the row's width, as the kernel does."""
    import torch

    n = len(self._staged_write_indices)
    if n == 0:
        return
    flat = self.gpu.view(-1)
    contents = torch.tensor(self._staged_write_contents, dtype=self.dtype)
    begin = 0
    for index, start, end in zip(
        self._staged_write_indices, self._staged_write_starts, self._staged_write_cu_lens, strict=True
    ):
        offset = index * self.gpu.stride(0) + start
        chunk = contents[begin:end]
        if offset + chunk.numel() > flat.numel():
            raise IndexError("staged write past the end of the tensor")
        flat[offset : offset + chunk.numel()] = chunk
        begin = end
    self.clear_staged_writes()


def main() -> None:
    model_dir = Path(sys.argv[1])
    result: dict[str, Any] = {}
    import numpy as np
    import torch
    from PIL import Image
    from transformers import BatchFeature, GlmImageProcessor
    from vllm import ModelRegistry
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldConfig,
        MultiModalKwargsItems,
        PlaceholderRange,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from helpers import source_image

    # Before vLLM's CPU-worker shim is imported: V2's buffers as they are on a CPU build of torch.
    assert "vllm.v1.worker.cpu.shm" not in sys.modules
    from vllm.v1.worker.gpu.mm.rope import RopeState

    try:
        RopeState(3, 1, 1, 1, torch.device("cpu"))
        result["rope_state_without_cpu_shim"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["rope_state_without_cpu_shim"] = f"{type(exc).__name__}: {exc}"
    import vllm.v1.worker.cpu.shm  # noqa: F401 - what every vLLM CPU worker process imports

    from vllm_omni_plugin.ar_worker.stage_outbox import STAGE_OUTBOX
    from vllm_omni_plugin.ar_worker.v1_cpu_runner import OmniCPUModelRunner

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, MODEL_CLASS)
    config = engine_config(
        str(model_dir / "vision_language_encoder"),
        tokenizer=str(model_dir / "processor"),
        **{**TINY_ENGINE_ARGS, "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE},
        max_num_seqs=MAX_NUM_SEQS,
        seed=0,
    )

    # --- prompts and source images, as GlmImageProcessor makes them ---
    processor = GlmImageProcessor.from_pretrained(model_dir / "processor")
    image_token_id = None
    prompts: dict[str, list[int]] = {}
    features: dict[str, list[Any]] = {}
    for name, (side, height, width) in CASES.items():
        content: list[dict[str, Any]] = []
        if side is not None:
            content.append({"type": "image", "image": Image.fromarray(source_image(side))})
        content.append({"type": "text", "text": "Make it blue" if side else "A photo of a cat"})
        inputs = processor.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=True, target_h=height, target_w=width,
            return_dict=True, return_tensors="pt",
        )  # fmt: skip
        prompts[name] = inputs["input_ids"][0].tolist()
        features[name] = []
        if side is not None:
            grid = inputs["image_grid_thw"][:1]  # the source image; the rest are target grids
            fields = {
                "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", grid.prod(-1)),
                "image_grid_thw": MultiModalFieldConfig.batched("image"),
            }
            item = MultiModalKwargsItems.from_hf_inputs(
                BatchFeature({"pixel_values": inputs["pixel_values"], "image_grid_thw": grid}), fields
            )["image"][0]
            if image_token_id is None:
                image_token_id = int(processor.tokenizer.convert_tokens_to_ids("<|image|>"))
            offset = prompts[name].index(image_token_id)
            length = int(grid.prod())
            assert prompts[name][offset : offset + length] == [image_token_id] * length
            features[name].append(
                MultiModalFeatureSpec(
                    data=item,
                    modality="image",
                    identifier=f"source-{name}",
                    mm_position=PlaceholderRange(offset=offset, length=length),
                )
            )
    result["prompt_lens"] = {name: len(ids) for name, ids in prompts.items()}

    with one_process(config):
        # --- V1: the real Omni CPU runner with the tiny model loaded (no KV cache: positions need none) ---
        runner, _ = loaded_runner(OmniCPUModelRunner, config)
        runner.use_async_scheduling = False  # positions do not depend on it; tokens are fed back below
        model = runner.get_model()
        # what the model's V2 hook would load (vLLM's CPU worker itself imports some of V2's modules)
        result["loaded_by_v1"] = {
            name: name in sys.modules
            for name in (
                "vllm_omni_plugin.ar_worker.planned_positions",
                "vllm.v1.worker.gpu.model_states.default",
            )
        }
        result["plans"] = {
            name: model.get_mrope_input_positions(prompts[name], features[name])[0].tolist() for name in CASES
        }

        # --- V2: the model state through vLLM's own factory, on the CPU worker's buffers ---
        import vllm.v1.worker.gpu.buffer_utils as buffer_utils
        from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
        from vllm.v1.worker.gpu.model_states import init_model_state, resolve_model_state_cls
        from vllm.v1.worker.gpu.states import RequestState

        state_cls = resolve_model_state_cls(config, model)
        result["state_cls"] = f"{state_cls.__module__}.{state_cls.__qualname__}"
        buffer_utils.StagedWriteTensor.apply_write = apply_write_on_cpu

        def run_scenario(spec: dict[str, Any]) -> dict[str, Any]:
            device = torch.device("cpu")
            # encoder_cache None: the positions do not use it (GLM-Image's source grids come from mm_features)
            state = init_model_state(config, model, None, device)
            req_states = RequestState(
                MAX_NUM_SEQS, MAX_MODEL_LEN, config.scheduler_config.max_num_batched_tokens, 0,
                config.model_config.get_vocab_size(), device,
            )  # fmt: skip
            buffers = InputBuffers(MAX_NUM_SEQS, config.scheduler_config.max_num_batched_tokens, device)
            cases = {rid: case for rid, (case, _) in spec["requests"].items()}
            max_tokens = {rid: n for rid, (_, n) in spec["requests"].items()}
            outputs: dict[str, list[int]] = {rid: [] for rid in cases}
            computed: dict[str, int] = {}
            seen_v1: set[str] = set()
            running: set[str] = set()  # in V1's persistent batch / V2's request states
            preempted: set[str] = set()
            finished: set[str] = set()
            just_finished: set[str] = set()
            steps_out: list[dict[str, Any]] = []
            slots: dict[str, list[int]] = {rid: [] for rid in cases}
            # what each runner's seam recorded for the next stage, each time it recorded (V1: the runner
            # mixin's _update_states; V2: the model state's add_request), from this process's outbox
            handed: dict[str, dict[str, list[Any]]] = {"v1": {}, "v2": {}}

            def take_outbox(side: str) -> None:
                for rid, outputs in STAGE_OUTBOX.take().items():
                    handed[side].setdefault(rid, []).append(outputs)

            for step_spec in spec["steps"]:
                for rid in step_spec.get("preempt", []):
                    running.discard(rid)
                    preempted.add(rid)
                    state.remove_request(rid)  # V2 drops a preempted request and adds it again on resume
                    req_states.remove_request(rid)
                for rid in just_finished:
                    state.remove_request(rid)
                    req_states.remove_request(rid)
                run = step_spec["run"]
                if run == "decode":
                    run = {rid: 1 for rid in sorted(running)}
                if not run and not step_spec.get("preempt"):
                    break
                resume = step_spec.get("resume", {})
                for rid, start in resume.items():
                    computed[rid] = start
                sched: dict[str, int] = {}
                for rid, n in run.items():
                    total = len(prompts[cases[rid]]) + len(outputs[rid])
                    sched[rid] = total - computed.get(rid, 0) if n == "rest" else n
                new_v1: list[Any] = []
                cached_ids: list[str] = []
                resumed_ids: set[str] = set()
                new_v2: list[tuple[str, list[int]]] = []
                for rid in sched:
                    prompt = prompts[cases[rid]]
                    params = SamplingParams(max_tokens=max_tokens[rid])
                    if rid not in seen_v1:
                        computed.setdefault(rid, 0)
                        new_v1.append(
                            NewRequestData(
                                req_id=rid, prompt_token_ids=list(prompt), mm_features=features[cases[rid]],
                                sampling_params=params, pooling_params=None, block_ids=([],),
                                num_computed_tokens=computed[rid], lora_request=None,
                            )
                        )  # fmt: skip
                        seen_v1.add(rid)
                        new_v2.append((rid, list(prompt)))
                    else:
                        cached_ids.append(rid)
                        if rid in preempted:
                            resumed_ids.add(rid)
                            new_v2.append((rid, list(prompt) + outputs[rid]))
                    running.add(rid)
                    preempted.discard(rid)
                cached = CachedRequestData(
                    req_ids=cached_ids,
                    resumed_req_ids=resumed_ids,
                    new_token_ids=[],
                    all_token_ids={rid: prompts[cases[rid]] + outputs[rid] for rid in resumed_ids},
                    new_block_ids=[([],) if rid in resumed_ids else None for rid in cached_ids],
                    num_computed_tokens=[computed[rid] for rid in cached_ids],
                    num_output_tokens=[len(outputs[rid]) for rid in cached_ids],
                )
                scheduler_output = SchedulerOutput(
                    scheduled_new_reqs=new_v1, scheduled_cached_reqs=cached, num_scheduled_tokens=dict(sched),
                    total_num_scheduled_tokens=sum(sched.values()), scheduled_spec_decode_tokens={},
                    scheduled_encoder_inputs={}, num_common_prefix_blocks=[0], finished_req_ids=set(just_finished),
                    free_encoder_mm_hashes=[], preempted_req_ids=set(step_spec.get("preempt", [])) or None,
                )  # fmt: skip
                just_finished = set()

                # V1: vLLM's computation, then the Omni runner's copy of the plan
                runner._update_states(scheduler_output)
                take_outbox("v1")
                if not sched:  # only preemptions: nothing runs
                    continue
                runner._calc_mrope_positions(scheduler_output)
                v1: dict[str, list[list[int]]] = {}
                ptr = 0
                for rid in runner.input_batch.req_ids:
                    n = sched[rid]
                    v1[rid] = runner.mrope_positions.cpu[:, ptr : ptr + n].tolist()
                    ptr += n

                # V2: new and resumed requests, then the step's inputs as GPUModelRunner.prepare_inputs lays
                # them out (batch order: reversed, so that batch rows and request slots differ)
                for rid, prefill in new_v2:
                    req_states.add_request(
                        req_id=rid, prompt_len=len(prompts[cases[rid]]), all_token_ids=prefill,
                        num_computed_tokens=computed[rid], max_tokens=max_tokens[rid],
                    )  # fmt: skip
                    index = req_states.req_id_to_index[rid]
                    slots[rid].append(index)
                    state.add_request(
                        index,
                        NewRequestData(
                            req_id=rid, prompt_token_ids=list(prompts[cases[rid]]),
                            mm_features=features[cases[rid]],
                            sampling_params=SamplingParams(max_tokens=max_tokens[rid]),
                            pooling_params=None, block_ids=([],), num_computed_tokens=computed[rid],
                            lora_request=None, prefill_token_ids=prefill,
                        ),
                    )  # fmt: skip
                take_outbox("v2")
                if new_v2:
                    req_states.apply_staged_writes()
                    state.apply_staged_writes()
                req_ids = sorted(sched, reverse=True)
                counts = np.array([sched[rid] for rid in req_ids], dtype=np.int32)
                num_tokens = int(counts.sum())
                padded_tokens = -(-num_tokens // 8) * 8
                idx_np = np.array([req_states.req_id_to_index[rid] for rid in req_ids], dtype=np.intp)
                for rid, index in zip(req_ids, idx_np, strict=True):
                    device_computed = int(req_states.num_computed_tokens.gpu[index])
                    assert device_computed == computed[rid], (rid, device_computed, computed[rid])
                dummy = InputBatch.make_dummy(len(req_ids), num_tokens, buffers)
                qsl_np = np.full(MAX_NUM_SEQS + 1, num_tokens, dtype=np.int32)  # padded as for a graph
                qsl_np[0] = 0
                np.cumsum(counts, out=qsl_np[1 : len(req_ids) + 1])
                buffers.query_start_loc.copy_(torch.from_numpy(qsl_np))
                batch = dataclasses.replace(
                    dummy,
                    req_ids=req_ids,
                    idx_mapping=torch.from_numpy(idx_np).to(torch.int64),
                    idx_mapping_np=idx_np,
                    num_scheduled_tokens=counts,
                    num_tokens=num_tokens,
                    num_tokens_after_padding=padded_tokens,
                    query_start_loc=buffers.query_start_loc[: MAX_NUM_SEQS + 1],
                    query_start_loc_np=qsl_np,
                )
                positions = state.prepare_inputs(batch, req_states)["positions"]
                assert positions.shape == (3, padded_tokens), positions.shape
                v2 = {
                    rid: positions[:, int(qsl_np[i]) : int(qsl_np[i + 1])].tolist()
                    for i, rid in enumerate(req_ids)
                }
                steps_out.append({"start": {rid: computed[rid] for rid in sched}, "v1": v1, "v2": v2})

                # after the step: V2 advances num_computed_tokens on the device; a request that reached its
                # end samples a token (fed back to V1's request state as its bookkeeping would)
                for rid in sched:
                    computed[rid] += sched[rid]
                    req_states.num_computed_tokens.gpu[req_states.req_id_to_index[rid]] += sched[rid]
                    total = len(prompts[cases[rid]]) + len(outputs[rid])
                    if computed[rid] < total:
                        continue
                    token = (7 * (len(outputs[rid]) + 1)) % 16384
                    outputs[rid].append(token)
                    runner.requests[rid].output_token_ids.append(token)
                    if len(outputs[rid]) >= max_tokens[rid] or total + 1 >= MAX_MODEL_LEN:
                        running.discard(rid)
                        finished.add(rid)
                        just_finished.add(rid)
            return {
                "cases": cases, "steps": steps_out, "slots": slots, "finished": sorted(finished),
                "handed": handed,
            }  # fmt: skip

        for name, spec in SCENARIOS.items():
            begin = time.perf_counter()
            try:
                result[name] = run_scenario(spec)
                result[name]["seconds"] = round(time.perf_counter() - begin, 2)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                result[name] = {
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc()[-1500:],
                }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
