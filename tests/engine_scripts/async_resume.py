"""The resume defence in the state a GPU is in: async scheduling on, through ``execute_model``.

vLLM's V1 runner under async scheduling records every sampled token as a ``-1`` placeholder (in the
request's ``output_token_ids`` and in the persistent batch's ``token_ids_cpu``, flagged as a token id):
the real id stays on the device. A request that left the persistent batch therefore cannot be rebuilt
from the runner's own state; only the scheduler's ``all_token_ids`` entry can bring it back. This script
loads the tiny model into the real Omni CPU runner with a real KV cache and async scheduling on (the CPU
runner then writes the same placeholders), and drives whole steps (``execute_model`` +
``sample_tokens``) with vLLM's real ``SchedulerOutput`` types:

- ``reference``: two requests decoded greedily, never interrupted;
- ``filled``: request ``a`` sits out a step and comes back with the entry the Omni scheduler sends;
- ``seed``: the same without the entry (what the seed's synchronous scheduler sent): ``a`` must be left
  out, ``b`` must still get its reference token;
- ``all_dropped``: ``a`` comes back alone without the entry: nothing is left to run in the step;
- ``placeholder_row``: the runner's fallback must not take a ``-1`` placeholder for a token.

Prints one JSON line ``RESULT {...}``; tests/test_ar_stage.py asserts on it. Run as a script: it
initialises vLLM's distributed state for one CPU process.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

from one_process import TINY_ENGINE_ARGS, engine_config, loaded_runner, make_scheduler, one_process

PROMPTS = {"a": [11, 12, 13, 14, 15, 16, 17, 18], "b": [21, 22, 23, 24, 25, 26, 27, 28]}


def main() -> None:
    model = sys.argv[1]
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    import vllm_omni_plugin.ar_worker.cpu_worker  # noqa: F401 - vLLM's CPU worker module first, as in a worker
    from vllm_omni_plugin.ar_channel import runner_extras
    from vllm_omni_plugin.ar_worker.v1_cpu_runner import OmniCPUModelRunner

    config = engine_config(model, **TINY_ENGINE_ARGS)
    config.scheduler_config.async_scheduling = True  # the CPU platform turns it off; a GPU has it on
    result: dict[str, Any] = {}
    with one_process(config):
        runner, kv_config = loaded_runner(OmniCPUModelRunner, config, kv_cache_bytes=1 << 20)
        result["async"] = bool(runner.use_async_scheduling)

        def step(output: SchedulerOutput) -> dict[str, Any]:
            """One whole step; sampled token per request (real ids), and who was left out."""
            try:
                out = runner.execute_model(output)
                if out is None:
                    out = runner.sample_tokens(None)
                out = out.get_output() if hasattr(out, "get_output") else out
            except Exception as exc:  # noqa: BLE001 - reported to the test
                return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
            extras = runner_extras(out)
            sampled = {
                rid: [int(t) for t in out.sampled_token_ids[i]]
                for rid, i in (out.req_id_to_index or {}).items()
            }
            return {"error": None, "sampled": sampled, "dropped": extras.dropped_req_ids if extras else []}

        def first_step(names: list[str]) -> tuple[SchedulerOutput, dict[str, list[int]]]:
            scheduler = make_scheduler(Scheduler, config, kv_config)
            for rid in names:
                prompt = PROMPTS[rid.split("_")[0]]
                scheduler.add_request(
                    Request(rid, list(prompt), SamplingParams(max_tokens=8, temperature=0), None)
                )
            return scheduler.schedule(), {}

        def cached(
            reqs: list[tuple[str, int, int]],
            all_token_ids: dict[str, list[int]],
            finished: set[str] = frozenset(),
        ) -> SchedulerOutput:
            """A step of requests already known: ``(id, num_computed_tokens, num_output_tokens)``, one token each."""
            data = CachedRequestData(
                req_ids=[r for r, _, _ in reqs],
                resumed_req_ids=set(),
                new_token_ids=[],
                all_token_ids=all_token_ids,
                new_block_ids=[None for _ in reqs],
                num_computed_tokens=[c for _, c, _ in reqs],
                num_output_tokens=[o for _, _, o in reqs],
            )
            return SchedulerOutput(
                scheduled_new_reqs=[],
                scheduled_cached_reqs=data,
                num_scheduled_tokens={r: 1 for r, _, _ in reqs},
                total_num_scheduled_tokens=len(reqs),
                scheduled_spec_decode_tokens={},
                scheduled_encoder_inputs={},
                num_common_prefix_blocks=[0],
                finished_req_ids=set(finished),
                free_encoder_mm_hashes=[],
            )

        def finish(names: list[str]) -> None:
            step(cached([], {}, set(names)))

        # reference: a and b decoded together, three tokens each
        ra, rb = "a_ref", "b_ref"
        out1 = step(first_step([ra, rb])[0])
        out2 = step(cached([(ra, 8, 1), (rb, 8, 1)], {}))
        out3 = step(cached([(ra, 9, 2), (rb, 9, 2)], {}))
        result["reference"] = {
            rid: [out1["sampled"][rid][0], out2["sampled"][rid][0], out3["sampled"][rid][0]]
            for rid in (ra, rb)
        }
        finish([ra, rb])
        first_a = out1["sampled"][ra][0]

        # the async placeholders a GPU holds: -1 in the request state and in the persistent batch
        a, b = "a_filled", "b_filled"
        step(first_step([a, b])[0])
        row = runner.input_batch.req_id_to_index[a]
        result["placeholders"] = {
            "output_token_ids": list(runner.requests[a].output_token_ids),
            "token_ids_cpu": int(runner.input_batch.token_ids_cpu[row, 8]),
            "is_token_id": bool(runner.input_batch.is_token_ids[row, 8]),
        }
        result["placeholder_row"] = runner._rebuild_token_ids(a, 1)
        # a sits out a step, then comes back with the entry the Omni scheduler fills
        step(cached([(b, 8, 1)], {}))
        back = step(cached([(a, 8, 1), (b, 9, 2)], {a: PROMPTS["a"] + [first_a]}))
        result["filled"] = back
        finish([a, b])

        # the seed: a comes back without the entry, b beside it
        a, b = "a_seed", "b_seed"
        step(first_step([a, b])[0])
        step(cached([(b, 8, 1)], {}))
        result["seed"] = step(cached([(a, 8, 1), (b, 9, 2)], {}))
        after = step(cached([(b, 10, 3)], {}))  # the engine goes on: b's next step
        result["seed_after"] = after
        finish([a, b])

        # a comes back alone without the entry: nothing left to run in the step
        a = "a_alone"
        step(first_step([a])[0])
        step(cached([], {}))  # a not scheduled: it leaves the persistent batch
        result["all_dropped"] = step(cached([(a, 8, 1)], {}))
        finish([a])
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
