"""The scheduler side of the context export KV connector in vLLM's real scheduler (the Omni one, loaded
through ``kv_transfer_config`` as an engine loads it): which requests it exports, that a request which
finishes in its prefill step (``max_tokens=1``) gets its handle, and that its blocks stay allocated until
the worker reports the copy done.

Prints one JSON line ``RESULT {...}``; tests/test_ar_stage.py asserts on it.
"""

from __future__ import annotations

import json
import sys

from one_process import TINY_ENGINE_ARGS, engine_config, make_scheduler


def main() -> None:
    model = sys.argv[1]
    from vllm.config import set_current_vllm_config
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    from vllm_omni_plugin.ar_channel import context_export_kv_transfer_config
    from vllm_omni_plugin.ar_worker.context_export import ContextExportWorkerMetadata
    from vllm_omni_plugin.schedulers.omni_ar_scheduler import OmniARScheduler

    connector = {"name": "ctx", "class": "SharedMemoryConnector", "extra": {}}
    config = engine_config(
        model,
        num_gpu_blocks=16,
        **{**TINY_ENGINE_ARGS, "block_size": 16},
        kv_transfer_config=context_export_kv_transfer_config(connector, None),
    )
    result: dict[str, object] = {}
    with set_current_vllm_config(config):  # a scheduler needs no distributed state
        scheduler = make_scheduler(OmniARScheduler, config)
        result["connector"] = type(scheduler.connector).__name__
        export = SamplingParams(max_tokens=1, extra_args={"omni": {"export_context": True}})
        scheduler.add_request(Request("ctx", list(range(1, 21)), export, None))  # 20 tokens: 2 blocks
        scheduler.add_request(Request("plain", list(range(1, 9)), SamplingParams(max_tokens=3), None))
        free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

        step = scheduler.schedule()
        meta = step.kv_connector_metadata
        result["exports"] = [[e.req_id, e.block_ids, e.num_tokens, e.next_position] for e in meta.exports]
        result["ctx_blocks"] = list(scheduler.kv_cache_manager.get_block_ids("ctx")[0])
        handle = {"kv": {"handle": "h"}, "kv_len": 20, "rope": 20, "export_s": 0.0}
        runner_output = ModelRunnerOutput(
            req_ids=["ctx", "plain"],
            req_id_to_index={"ctx": 0, "plain": 1},
            sampled_token_ids=[[5], [6]],
            kv_connector_output=KVConnectorOutput(
                kv_connector_worker_meta=ContextExportWorkerMetadata(
                    stage_outputs={"ctx": {"context": handle}}
                )
            ),
        )
        outputs = scheduler.update_from_output(step, runner_output)
        flat = {o.request_id: o for bucket in outputs.values() for o in bucket.outputs}
        result["ctx_finished"] = str(flat["ctx"].finish_reason)
        result["ctx_params"] = flat["ctx"].kv_transfer_params
        result["plain_params"] = flat["plain"].kv_transfer_params
        result["held_after_finish"] = "ctx" in scheduler.requests
        plain_blocks = len(scheduler.kv_cache_manager.get_block_ids("plain")[0])
        result["free_while_held"] = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

        step = scheduler.schedule()  # the worker hears that "ctx" finished and reports its copy done
        result["finished_sent_to_worker"] = sorted(step.finished_req_ids)
        result["no_second_export"] = step.kv_connector_metadata.exports == []
        runner_output = ModelRunnerOutput(
            req_ids=["plain"],
            req_id_to_index={"plain": 0},
            sampled_token_ids=[[7]],
            kv_connector_output=KVConnectorOutput(finished_sending={"ctx"}),
        )
        scheduler.update_from_output(step, runner_output)
        result["held_after_copy"] = "ctx" in scheduler.requests
        result["free_after_copy"] = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        result["free_before"] = free_before
        result["plain_blocks"] = plain_blocks
        result["stage_outputs_left"] = len(scheduler._omni_stage_outputs)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
