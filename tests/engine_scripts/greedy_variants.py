"""Run greedy generation of a tiny text model in a real vLLM engine, once per scheduler/worker variant,
and print the token ids as JSON. Run as a script (engines spawn processes; keep the main guard)."""

from __future__ import annotations

import json
import sys

VARIANTS = {
    "stock": {},
    "omni_sync": {
        "scheduler_cls": "vllm_omni_plugin.schedulers.omni_ar_scheduler.OmniARScheduler",
        "worker_cls": "vllm_omni_plugin.ar_worker.cpu_worker.OmniCPUWorker",
    },
    "omni_async_variant": {
        "scheduler_cls": "vllm_omni_plugin.schedulers.omni_ar_scheduler.OmniARAsyncScheduler",
        "worker_cls": "vllm_omni_plugin.ar_worker.cpu_worker.OmniCPUWorker",
    },
}
PROMPTS = ["the quick brown fox", "a photo of a cat", "what is the capital of france", "hello world one two"]


def main() -> None:
    model, kv_bytes, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    names = sys.argv[4].split(",")
    from vllm import LLM, SamplingParams

    results = {}
    for name in names:
        llm = LLM(
            model=model,
            enforce_eager=True,
            dtype="float32",
            kv_cache_memory_bytes=kv_bytes,
            max_model_len=96,
            max_num_seqs=4,
            block_size=32,
            enable_prefix_caching=False,
            seed=0,
            disable_log_stats=False,
            **VARIANTS[name],
        )
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.llm_engine.get_metrics() if hasattr(llm.llm_engine, "get_metrics") else []
        preemptions = sum(
            getattr(m, "value", 0) for m in stats if getattr(m, "name", "") == "vllm:num_preemptions"
        )
        results[name] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "preemptions": preemptions,
        }
        llm.llm_engine.engine_core.shutdown()
        del llm
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
