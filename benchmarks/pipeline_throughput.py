"""Images/s of the tiny GLM-Image: diffusers' ``GlmImagePipeline`` run sequentially vs our offline API
(AR in a vLLM engine, DiT in a StageDiffusionCoreProc) at concurrency 1, 4 and 16, in the same run.

    python benchmarks/pipeline_throughput.py [--model DIR] [--images 16] [--size 64] [--steps 4]

Target: >= 4x the sequential diffusers baseline at concurrency 16.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEPLOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deploy", "tiny_glm_image_cpu.yaml")


def baseline(model: str, n: int, size: int, steps: int) -> float:
    import torch
    from diffusers import GlmImagePipeline

    pipe = GlmImagePipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def one(i: int) -> None:
        generator = torch.Generator().manual_seed(i)
        pipe(f"a red fox number {i}", height=size, width=size, num_inference_steps=steps, generator=generator)

    one(0)  # warm-up
    start = time.perf_counter()
    for i in range(n):
        one(i)
    return n / (time.perf_counter() - start)


def ours(model: str, concurrencies: list[int], n: int, size: int, steps: int) -> dict[int, float]:
    from vllm_omni_plugin.entrypoints.omni import Omni
    from vllm_omni_plugin.stage.orchestrator import OmniRequest

    rates = {}
    with Omni(model, deploy_config=DEPLOY) as omni:
        omni.generate(
            [OmniRequest(prompt="warm-up", height=size, width=size, num_inference_steps=steps, seed=0)]
        )
        for concurrency in concurrencies:
            total = max(n, concurrency)
            requests = [
                OmniRequest(
                    prompt=f"a red fox number {i}", height=size, width=size, num_inference_steps=steps, seed=i
                )
                for i in range(total)
            ]
            start = time.perf_counter()
            for wave in range(0, total, concurrency):  # `concurrency` requests in flight at a time
                results = omni.generate(requests[wave : wave + concurrency])
                failed = [r.error for r in results if not r.ok]
                if failed:
                    raise RuntimeError(f"requests failed: {failed[:3]}")
            rates[concurrency] = total / (time.perf_counter() - start)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="GLM-Image directory (default: the tiny build)")
    parser.add_argument("--images", type=int, default=16, help="images per measurement")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from vllm_omni_plugin.tiny_models import build

        model = str(build("glm-image", os.path.join(".cache", "tiny_models", "glm-image")))
    base = baseline(model, max(4, args.images // 2), args.size, args.steps)
    rates = ours(model, [1, 4, 16], args.images, args.size, args.steps)
    print(f"\nmodel={model} size={args.size} steps={args.steps} images={args.images}")
    print(f"{'runner':<36} {'images/s':>9} {'x baseline':>11}")
    print(f"{'diffusers GlmImagePipeline (seq.)':<36} {base:>9.2f} {1.0:>11.2f}")
    for concurrency, rate in rates.items():
        print(f"{f'vllm-omni-plugin, concurrency {concurrency}':<36} {rate:>9.2f} {rate / base:>11.2f}")
    print(f"target: >= 4x at concurrency 16 -> {rates[16] / base:.2f}x")


if __name__ == "__main__":
    main()
