"""Decode throughput of a text model: the Omni AR scheduler + worker vs stock vLLM, in the same run.

    python benchmarks/ar_stage_throughput.py [--model DIR] [--rounds 3] [--requests 16] [--tokens 128]

Engines run in this process one after another (A B A B ...), each warmed up before it is timed; the
printed ratio is Omni tokens/s over stock tokens/s (target >= 0.98).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

VARIANTS = {
    "stock": {},
    "omni": {
        "scheduler_cls": "vllm_omni_plugin.schedulers.omni_ar_scheduler.OmniARScheduler",
        "worker_cls": "vllm_omni_plugin.ar_worker.cpu_worker.OmniCPUWorker",
    },
}


def measure(model: str, variant: str, requests: int, tokens: int, repeats: int) -> list[float]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        enforce_eager=True,
        dtype="float32",
        kv_cache_memory_bytes=64 << 20,
        max_model_len=tokens + 32,
        max_num_seqs=requests,
        seed=0,
        **VARIANTS[variant],
    )
    prompts = [f"request {i}: the quick brown fox" for i in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    llm.llm_engine.engine_core.shutdown()
    del llm
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model directory (default: the tiny text model)")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds (each builds both engines)")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per engine")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from vllm_omni_plugin.tiny_models import build

        model = str(build("text", os.path.join(".cache", "tiny_models", "text")))
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name in VARIANTS:
            rates[name] += measure(model, name, args.requests, args.tokens, args.repeats)
    print(f"\nmodel={model} requests={args.requests} tokens={args.tokens} rounds={args.rounds}")
    print(f"{'variant':<8} {'median tok/s':>13} {'min':>9} {'max':>9}")
    for name, values in rates.items():
        print(f"{name:<8} {statistics.median(values):>13.1f} {min(values):>9.1f} {max(values):>9.1f}")
    ratio = statistics.median(rates["omni"]) / statistics.median(rates["stock"])
    print(f"ratio omni/stock (median tokens/s): {ratio:.3f}  (target >= 0.98)")


if __name__ == "__main__":
    main()
