"""DiT acceleration in the diffusion stage's engine, in one run: tiny SD3, FLUX and GLM-Image at 28 steps
(64x64, guided), uncached (the baseline) against each step-caching policy, compiled blocks, and CFG and
sequence parallelism over two processes. ``--models bagel bagel-edit`` adds BAGEL's DiT (text to image,
and edits with three guidance branches) on random contexts of the thinker's shapes.

    python benchmarks/dit_acceleration.py [--models sd3 flux glm-image] [--steps 28] [--rounds 3]
                          [--variants uncached fixed half fixed-3 threshold compiled cfg-parallel
                                      sequence-parallel]

Each variant is a ``DiffusionEngine`` as the stage builds it (``cache`` / ``compile`` as a deploy file's
stage would set them), in this process with one thread. Concurrency 1: one request at a time; 8: eight
requests handed over at once (one batch). Figures are medians of ``--rounds`` timed rounds after a
warm-up round; ratios are against ``uncached`` at the same concurrency; ``blocks`` is the share of block
evaluations computed (the engine's counters: computed / (computed + cached)). ``cfg-parallel`` and
``sequence-parallel`` run a second process (one more core: the ranks take one thread each).

Targets on CPU: >= 1.5x at concurrency 1 with the policy that computes about half the steps (``half``:
warm-up 2, then one in 2: 15 of 28); compiled not slower than eager (>= 1.0x).

On a GPU, the work a GPU does (SD3 medium's DiT and VAE at their real shapes, random weights, bfloat16,
1024x1024; the model is built first, 4 GB)::

    python benchmarks/dit_acceleration.py --device cuda --dtype bfloat16 --models sd3-medium-shape \
        --size 1024 --concurrency 1 4 --rounds 1 --variants uncached half fixed-3 compiled
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
SIZE = 64
"""The default image size (``--size``)."""
VARIANTS: dict[str, dict[str, Any]] = {
    "uncached": {},
    "fixed": {"cache": {"policy": "fixed"}},
    "half": {"cache": {"policy": "fixed", "final_steps": 0}},
    "fixed-3": {"cache": {"policy": "fixed", "compute_every": 3}},
    "threshold": {"cache": {"policy": "threshold", "threshold": 0.1}},
    "compiled": {"compile": {"blocks": True}},  # warm-up at --size
    "cfg-parallel": {"cfg_parallel_size": 2},
    "sequence-parallel": {"sequence_parallel_size": 2},
}
"""Engine arguments of each variant (what a stage's ``cache`` / ``compile`` block resolves to)."""
HALF = "half"
"""The policy that computes about half the steps (warm-up 2, then one in 2, no final step: 15 of 28):
the 1.5x target is its. ``fixed`` is the defaults (16 of 28), ``fixed-3`` one in 3 (12 of 28)."""
CONCURRENCY = (1, 8)
"""The default concurrencies (``--concurrency``)."""


BAGEL_RUNNER = "vllm_omni_plugin.families.bagel.runner.BagelGenerationRunner"
BAGEL_MODELS = {"bagel": "text-to-image", "bagel-edit": "edit"}
"""BAGEL's DiT stage (the tiny BAGEL) on random contexts shaped as the thinker sends them: text to image
(cond and no-text rows) or an edit (cond, no-text and no-image rows: three branches)."""


def bagel_requests(path: Path, kind: str, count: int, steps: int, offset: int, size: int) -> list[Any]:
    """``count`` BAGEL generation requests; an edit's source image adds its VAE and ViT tokens."""
    import msgspec
    import torch

    from vllm_omni_plugin.families.bagel import (
        EDIT_DEFAULTS,
        T2I_DEFAULTS,
        BagelContext,
        BagelGenerationRequest,
    )
    from vllm_omni_plugin.models.bagel.config import load_bagel_config

    llm = load_bagel_config(str(path)).llm

    def context(seed: int, length: int, rope: int) -> Any:
        shape = (llm.num_layers, 2, length, llm.num_kv_heads, llm.head_dim)
        kv = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        return BagelContext(kv=kv, kv_len=length, rope=rope)

    text, image = 12, (size // 16) ** 2 + (size // 14) ** 2 + 4
    made = []
    for i in range(offset, offset + count):
        if kind == "edit":
            source, prompt = context(2 * i, image, 2), context(2 * i + 1, text, text)
            joined = torch.cat([source.kv, prompt.kv], dim=2)
            contexts = (BagelContext(kv=joined, kv_len=image + text, rope=2 + text), source, prompt)
            defaults = EDIT_DEFAULTS
        else:
            cond = context(i, text, text)
            contexts, defaults = (cond, BagelContext.empty(), cond), T2I_DEFAULTS
        made.append(
            BagelGenerationRequest(
                request_id=f"r{i}", cond=contexts[0], cfg_text=contexts[1], cfg_img=contexts[2],
                height=size, width=size, seed=i,
                sampling=msgspec.structs.replace(defaults, num_inference_steps=steps),
            )
        )  # fmt: skip
    return made


def requests(
    model: str, count: int, steps: int, offset: int, size: int = SIZE, path: Path | None = None
) -> list[Any]:
    """``count`` square requests of ``model`` (GLM-Image's with random prior tokens: its DiT takes any)."""
    import torch

    from vllm_omni_plugin.diffusion import DiffusionRequest

    if model in BAGEL_MODELS:
        assert path is not None
        return bagel_requests(path, BAGEL_MODELS[model], count, steps, offset, size)
    made = []
    for i in range(offset, offset + count):
        fields: dict[str, Any] = {
            "request_id": f"r{i}",
            "prompt": f"a red fox number {i} in the snow",
            "height": size,
            "width": size,
            "num_inference_steps": steps,
            "seed": i,
        }
        if model == "glm-image":
            from vllm_omni_plugin.families.glm_image.runner import GlmImageRequest

            ids = torch.randint(0, 16384, ((size // 16) ** 2,), generator=torch.Generator().manual_seed(i))
            made.append(GlmImageRequest(**fields, prior_token_ids=ids))
        else:
            made.append(DiffusionRequest(**fields))
    return made


def measure(
    engine: Any, model: str, steps: int, concurrency: int, rounds: int, size: int, path: Path
) -> float:
    """Median images/s over ``rounds`` (after one warm-up round)."""
    rates = []
    for round_ in range(rounds + 1):
        start = time.perf_counter()
        if concurrency == 1:
            for i in range(2):
                results = engine.generate(requests(model, 1, steps, 100 * round_ + i, size, path))
        else:
            results = engine.generate(requests(model, concurrency, steps, 100 * round_, size, path))
        if not all(r.ok for r in results):
            raise RuntimeError(f"{model}: {[r.error for r in results if not r.ok]}")
        images = 2 if concurrency == 1 else concurrency
        if round_:
            rates.append(images / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["sd3", "flux", "glm-image"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=SIZE, help="image height and width in pixels")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--device", default="cpu", help="the engines' device (cuda: its first GPU)")
    parser.add_argument("--dtype", default=None, help="the engines' dtype (default: the engine's own)")
    args = parser.parse_args()
    import torch

    from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig
    from vllm_omni_plugin.tiny_models import build

    if args.device == "cpu":
        torch.set_num_threads(1)
    else:
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    concurrency = tuple(args.concurrency)
    device_args: dict[str, Any] = {"max_batch_size": max(concurrency)}
    if args.dtype:
        device_args["dtype"] = args.dtype
    cache_dir = Path(os.environ.get("VLLM_OMNI_TINY_MODEL_CACHE", ROOT / ".cache" / "tiny_models"))
    variants = ["uncached", *(v for v in args.variants if v != "uncached")]
    rows: list[tuple[str, str, dict[int, float], float, float]] = []
    for model in args.models:
        start = time.perf_counter()
        kind = "bagel" if model in BAGEL_MODELS else model
        path = build(kind, cache_dir / kind)
        print(f"{model}: built in {time.perf_counter() - start:.1f} s", flush=True)
        for variant in variants:
            start = time.perf_counter()
            engine_args = {**device_args, **VARIANTS[variant]}
            if model in BAGEL_MODELS:
                engine_args["runner_cls"] = BAGEL_RUNNER
            if "compile" in engine_args:  # warmed up at the size measured
                engine_args["compile"] = {**engine_args["compile"], "warmup_sizes": [[args.size, args.size]]}
            try:
                engine = DiffusionEngine(
                    path, DiffusionEngineConfig.from_args(engine_args), device=args.device
                )
            except ValueError as exc:  # a runner without it
                print(f"{model:10s} {variant:10s} not available: {exc}", flush=True)
                continue
            ready = time.perf_counter() - start
            try:
                rates = {
                    c: measure(engine, model, args.steps, c, args.rounds, args.size, path)
                    for c in concurrency
                }
                counts = engine.counters()
            finally:
                engine.close()
            done = counts.computed_blocks + counts.cached_blocks
            share = counts.computed_blocks / done if done else 1.0
            rows.append((model, variant, rates, share, ready))
            print(f"{model:10s} {variant:10s} " + " ".join(f"c={c}: {r:6.2f} img/s" for c, r in rates.items())
                  + f"  blocks computed {share:.2f}  start-up {ready:.1f} s", flush=True)  # fmt: skip
    print("\nimages/s (x uncached at the same concurrency), share of block evaluations computed")
    print(
        f"{'model':10s} {'variant':10s} "
        + " ".join(f"{'c=' + str(c):>16s}" for c in concurrency)
        + "  blocks"
    )
    base = {(m, c): r[c] for m, v, r, _, _ in rows if v == "uncached" for c in concurrency}
    verdicts = []
    for model, variant, rates, share, _ in rows:
        ratios = {c: rates[c] / base[(model, c)] for c in concurrency}
        cells = " ".join(f"{rates[c]:7.2f} ({ratios[c]:4.2f}x)" for c in concurrency)
        print(f"{model:10s} {variant:10s} {cells}  {share:.2f}")
        if variant == HALF and 1 in ratios:
            verdicts.append((f"{model} {HALF} c=1 >= 1.5x", ratios[1] >= 1.5, ratios[1]))
        if variant == "compiled":
            worst = min(ratios.values())
            verdicts.append((f"{model} compiled >= 1.0x eager", worst >= 1.0, worst))
    print()
    for name, met, value in verdicts:
        print(f"{'met' if met else 'NOT met'}: {name} ({value:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
