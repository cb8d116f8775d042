"""The production crash this project was started from, with vLLM's real classes: a request that must be
rebuilt by the model runner under async scheduling, with no ``all_token_ids`` entry from the scheduler
(a legacy config had pinned the synchronous scheduler while async scheduling was on; the runner's
``KeyError`` killed the engine core).

Prints one JSON line ``RESULT {...}``; tests/test_ar_stage.py asserts on it. Run as a script: it
initialises vLLM's distributed state for one CPU process.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from one_process import TINY_ENGINE_ARGS, engine_config, make_scheduler, no_kv_cache_config, one_process


def main() -> None:
    model = sys.argv[1]
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    import vllm_omni_plugin.ar_worker.cpu_worker  # noqa: F401 - vLLM's CPU worker module first, as in a worker
    from vllm_omni_plugin.ar_channel import RUNNER_OUTPUT_ATTR, OmniRunnerOutput
    from vllm_omni_plugin.ar_worker.v1_cpu_runner import CPUModelRunner
    from vllm_omni_plugin.schedulers.omni_ar_scheduler import (
        OmniARAsyncScheduler,
        OmniARScheduler,
        OmniARSchedulerMixin,
    )

    config = engine_config(model, num_gpu_blocks=16, **TINY_ENGINE_ARGS)
    result: dict[str, object] = {}
    with one_process(config):
        prompt = [11, 12, 13, 14, 15, 16, 17, 18]
        outputs = [201, 202, 203]

        # 1. Each scheduler variant fills all_token_ids for a resumed request, even one that was
        #    scheduled in the previous step (where stock vLLM leaves it out).
        for cls in (Scheduler, OmniARScheduler, OmniARAsyncScheduler):
            scheduler = make_scheduler(cls, config)
            request = Request("r0", list(prompt), SamplingParams(max_tokens=16), None)
            scheduler.add_request(request)
            first = scheduler.schedule()
            request.append_output_token_ids(outputs)
            blocks = scheduler.kv_cache_manager.get_blocks("r0")
            data = scheduler._make_cached_request_data(
                running_reqs=[], resumed_reqs=[request], num_scheduled_tokens={"r0": 1},
                spec_decode_tokens={}, req_to_new_blocks={"r0": blocks},
            )  # fmt: skip
            result[f"fills_{cls.__name__}"] = data.all_token_ids.get("r0") == prompt + outputs
            result[f"first_step_{cls.__name__}"] = first.total_num_scheduled_tokens

        # 2. vLLM's own runner on its async resume path, without the entry: the seed's KeyError.
        def run_runner(cls, output_token_ids):
            runner = cls(config, torch.device("cpu"))
            runner.use_async_scheduling = True
            runner.kv_cache_config = no_kv_cache_config()  # no model loaded: no attention backends
            scheduler = make_scheduler(Scheduler, config)
            request = Request("r0", list(prompt), SamplingParams(max_tokens=16), None)
            scheduler.add_request(request)
            step1 = scheduler.schedule()
            runner._update_states(step1)
            runner.requests["r0"].output_token_ids.extend(output_token_ids)
            blocks = scheduler.kv_cache_manager.get_blocks("r0").get_block_ids()
            resumed = CachedRequestData(
                req_ids=["r0"],
                resumed_req_ids={"r0"},
                new_token_ids=[],
                all_token_ids={},  # what the seed's sync scheduler sent
                new_block_ids=[blocks],
                num_computed_tokens=[len(prompt) + len(outputs) - 1],
                num_output_tokens=[len(outputs)],
            )
            step2 = SchedulerOutput(
                scheduled_new_reqs=[],
                scheduled_cached_reqs=resumed,
                num_scheduled_tokens={"r0": 1},
                total_num_scheduled_tokens=1,
                scheduled_spec_decode_tokens={},
                scheduled_encoder_inputs={},
                num_common_prefix_blocks=[0],
                finished_req_ids=set(),
                free_encoder_mm_hashes=[],
            )
            try:
                runner._update_states(step2)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-800:]}
            return {"error": None}

        result["stock_runner"] = run_runner(CPUModelRunner, outputs)
        # (The Omni runner's side of this, in the state a GPU is in, is engine_scripts/async_resume.py.)

        # 1b. With vLLM's V2 model runner (which never reads all_token_ids) nothing is added.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        try:
            for cls in (OmniARScheduler, OmniARAsyncScheduler):
                scheduler = make_scheduler(cls, config)
                request = Request("r0", list(prompt), SamplingParams(max_tokens=16), None)
                scheduler.add_request(request)
                scheduler.schedule()
                request.append_output_token_ids(outputs)
                data = scheduler._make_cached_request_data(
                    running_reqs=[], resumed_reqs=[request], num_scheduled_tokens={"r0": 1},
                    spec_decode_tokens={}, req_to_new_blocks={"r0": scheduler.kv_cache_manager.get_blocks("r0")},
                )  # fmt: skip
                result[f"v2_fills_{cls.__name__}"] = "r0" in data.all_token_ids
        finally:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")

        # 1c. A base whose _make_cached_request_data has vLLM 0.34's four parameters (no resumed_reqs:
        #     0.34 sends a resumed request again whole). The stand-in passes them on to this vLLM's own
        #     method; the Omni override takes them as given, positionally or by name, and reads
        #     running_reqs by name: a request it must fill (not scheduled in the previous step) is filled.
        class SchedulerOf034(Scheduler):
            def _make_cached_request_data(
                self, running_reqs, num_scheduled_tokens, spec_decode_tokens, req_to_new_blocks
            ):
                return super()._make_cached_request_data(
                    running_reqs, [], num_scheduled_tokens, spec_decode_tokens, req_to_new_blocks
                )

        class OmniOn034(OmniARSchedulerMixin, SchedulerOf034):
            pass

        scheduler = make_scheduler(OmniARScheduler, config)
        request = Request("r0", list(prompt), SamplingParams(max_tokens=16), None)
        scheduler.add_request(request)
        scheduler.schedule()  # this vLLM's schedule() calls the five-argument form
        scheduler.__class__ = OmniOn034  # the same scheduler, on the 0.34-shaped base from here
        request.append_output_token_ids(outputs)
        blocks = {"r0": scheduler.kv_cache_manager.get_blocks("r0")}
        scheduler.prev_step_scheduled_req_ids = set()  # not scheduled in the previous step
        by_position = scheduler._make_cached_request_data([request], {"r0": 1}, {}, blocks)
        by_name = scheduler._make_cached_request_data(
            running_reqs=[request], num_scheduled_tokens={"r0": 1}, spec_decode_tokens={},
            req_to_new_blocks=blocks,
        )  # fmt: skip
        result["on_034_fills"] = [
            data.all_token_ids.get("r0") == prompt + outputs and data.req_ids == ["r0"]
            for data in (by_position, by_name)
        ]

        # 3. The scheduler turns a request the runner left out into an error for that request only.
        for cls in (OmniARScheduler, OmniARAsyncScheduler):
            scheduler = make_scheduler(cls, config)
            for rid in ("a", "b"):
                scheduler.add_request(Request(rid, list(prompt), SamplingParams(max_tokens=4), None))
            step = scheduler.schedule()
            runner_output = ModelRunnerOutput(
                req_ids=["b"], req_id_to_index={"b": 0}, sampled_token_ids=[[42]]
            )
            setattr(runner_output, RUNNER_OUTPUT_ATTR, OmniRunnerOutput(dropped_req_ids=["a"]))  # left out
            outs = scheduler.update_from_output(step, runner_output)
            flat = [o for bucket in outs.values() for o in bucket.outputs]
            result[f"dropped_{cls.__name__}"] = {
                o.request_id: [o.new_token_ids, str(o.finish_reason), o.stop_reason] for o in flat
            }
            result[f"still_serving_{cls.__name__}"] = sorted(scheduler.requests)

        # 4. Hooks and stage outputs.
        class Recording(OmniARScheduler):
            events: list = []

            def on_prefill_finished(self, request):
                self.events.append(["prefill_finished", request.request_id])

            def on_trigger_token(self, request, token_id):
                self.events.append(["trigger", request.request_id, token_id])

        scheduler = make_scheduler(Recording, config)
        params = SamplingParams(max_tokens=2, extra_args={"omni": {"trigger_token_ids": [77]}})
        scheduler.add_request(Request("h", list(prompt), params, None))
        step = scheduler.schedule()
        runner_output = ModelRunnerOutput(req_ids=["h"], req_id_to_index={"h": 0}, sampled_token_ids=[[5]])
        stage_outputs = {"h": {"source_prior_token_ids": [1, 2, 3]}}
        setattr(runner_output, RUNNER_OUTPUT_ATTR, OmniRunnerOutput(stage_outputs=stage_outputs))
        outs = scheduler.update_from_output(step, runner_output)
        (first,) = [o for bucket in outs.values() for o in bucket.outputs]
        step = scheduler.schedule()
        outs = scheduler.update_from_output(
            step, ModelRunnerOutput(req_ids=["h"], req_id_to_index={"h": 0}, sampled_token_ids=[[77]])
        )
        (last,) = [o for bucket in outs.values() for o in bucket.outputs]
        result["hook_events"] = Recording.events
        result["stage_output_params_first"] = first.kv_transfer_params
        result["stage_output_params_final"] = [last.kv_transfer_params, str(last.finish_reason)]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
