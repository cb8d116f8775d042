"""Per-step time of BAGEL's generation runner on the tiny BAGEL: a batch of B edit-style requests (all three
CFG branches at every step) vs the same B requests run one at a time, in the same run.

    python benchmarks/bagel_dit_step.py [--model DIR] [--batch 8] [--size 64] [--steps 20] [--device cpu]

Prints seconds per denoising step at batch 1 and batch B, and the batched speed-up (images/s ratio).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")


def requests(count: int, size: int, steps: int, layers: int, kv_heads: int, head_dim: int) -> list:
    import msgspec
    import torch

    from vllm_omni_plugin.families.bagel import EDIT_DEFAULTS, BagelContext, BagelGenerationRequest

    def ctx(gen: torch.Generator, length: int, rope: int) -> BagelContext:
        kv = torch.randn((layers, 2, length, kv_heads, head_dim), generator=gen)
        return BagelContext(kv=kv, kv_len=length, rope=rope)

    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        image_len, text_len = 40 + 4 * i, 8 + i  # different context lengths across the batch
        out.append(
            BagelGenerationRequest(
                request_id=f"r{i}",
                cond=ctx(gen, image_len + text_len, 2 + text_len),
                cfg_text=ctx(gen, image_len, 2),
                cfg_img=ctx(gen, text_len, text_len),
                height=size,
                width=size,
                sampling=msgspec.structs.replace(EDIT_DEFAULTS, num_inference_steps=steps),
                seed=i,
            )
        )
    return out


def per_step(runner, batch: list, steps: int, repeats: int) -> float:
    import torch

    times = []
    for _ in range(repeats):
        out = runner.run(batch, [torch.Generator().manual_seed(r.seed) for r in batch])
        times.append(out.timings["denoise"] / (steps - 1))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="BAGEL model directory (default: build the tiny one)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    import torch

    from vllm_omni_plugin.families.bagel import BagelGenerationRunner

    model = args.model
    if model is None:
        from vllm_omni_plugin.tiny_models import build

        default_cache = os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "tiny_models"
        )
        model = str(
            build("bagel", os.path.join(os.environ.get("VLLM_OMNI_TINY_MODEL_CACHE", default_cache), "bagel"))
        )
    runner = BagelGenerationRunner.load(model, dtype=getattr(torch, args.dtype), device=args.device)
    llm = runner.cfg.llm
    batch = requests(args.batch, args.size, args.steps, llm.num_layers, llm.num_kv_heads, llm.head_dim)
    per_step(runner, batch[:1], args.steps, 1)  # warm-up
    per_step(runner, batch, args.steps, 1)

    one_at_a_time = [per_step(runner, [r], args.steps, args.repeats) for r in batch]
    batched = per_step(runner, batch, args.steps, args.repeats)
    single = statistics.median(one_at_a_time)
    print(f"{model}: {args.size}x{args.size}, {args.steps} steps, 3 CFG branches, {args.device} {args.dtype}")
    print(f"batch 1: {single * 1e3:.2f} ms/step (3 rows per step)")
    print(f"batch {args.batch}: {batched * 1e3:.2f} ms/step ({3 * args.batch} rows per step)")
    print(f"batched vs one at a time: {args.batch * single / batched:.2f}x images/s")


if __name__ == "__main__":
    main()
