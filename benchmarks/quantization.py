"""Quantized diffusion stages, in one run: per tiny model and scheme, the denoiser's weight memory, images
per second and pixel distance, against the same model unquantized (the baseline, in the same run).

    python benchmarks/quantization.py [--models sd3 flux qwen-image glm-image] [--steps 8] [--rounds 3]
                                      [--schemes none int8_weight_only int8_dynamic float8_weight_only gguf]

Each row is a ``DiffusionEngine`` as a stage with that ``quantization`` builds it, in this process with
one thread: a batch of ``--batch`` requests (64x64, guided) handed over at once, timed over ``--rounds``
rounds after a warm-up round (median). ``weights`` is the denoiser as held (torchao's int8 / float8 data
and scales; GGUF Q8_0 blocks, written here from the model's own weights) and its ratio to the same
denoiser unquantized; ``speed`` is images/s over the baseline's; ``distance`` the largest and mean
per-pixel difference from the baseline's images, in 1/255 levels. GGUF rows are for the families
diffusers reads single files of (not GLM-Image's DiT).

Target on CPU: int8 weight-only not slower than 0.8x unquantized.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
SCHEMES = ("none", "int8_weight_only", "int8_dynamic", "float8_weight_only", "gguf")
MODELS = ("sd3", "flux", "qwen-image", "glm-image")
SIZE = 64
INT8_TARGET = 0.8


def requests(kind: str, count: int, steps: int, size: int) -> list[Any]:
    """``count`` guided square requests (GLM-Image's DiT with random prior tokens: it takes any)."""
    import torch

    from vllm_omni_plugin.diffusion import DiffusionRequest
    from vllm_omni_plugin.families.glm_image.runner import GlmImageRequest

    made: list[Any] = []
    for i in range(count):
        fields: dict[str, Any] = {
            "request_id": f"r{i}",
            "prompt": f"a lantern on a pier {i}",
            "height": size,
            "width": size,
            "num_inference_steps": steps,
            "guidance_scale": 2.0,
            "seed": i,
        }
        if kind == "glm-image":
            ids = torch.randint(0, 16384, ((size // 16) ** 2,), generator=torch.Generator().manual_seed(i))
            made.append(GlmImageRequest(**fields, prior_token_ids=ids))
        else:
            made.append(DiffusionRequest(**fields))
    return made


LINEAR_SHAPES = ((8, 32, 128), (64, 256, 1024), (256, 1024, 4096))
"""(tokens, width, inner): the tiny models' feed-forward, and wider ones toward the real models'."""


def linear_pair_seconds(tokens: int, width: int, inner: int) -> tuple[float, float]:
    """Seconds of one forward of a feed-forward pair, float32 and with int8 weight-only weights (median of
    a second's repeats each): where the tensor subclass's dispatch cost stops mattering."""
    import torch
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    generator = torch.Generator().manual_seed(0)
    pair = torch.nn.Sequential(torch.nn.Linear(width, inner), torch.nn.Linear(inner, width))
    x = torch.randn(tokens, width, generator=generator)

    def timed() -> float:
        with torch.no_grad():
            for _ in range(3):
                pair(x)
            runs = []
            deadline = time.perf_counter() + 1.0
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                pair(x)
                runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    plain = timed()
    quantize_(pair, Int8WeightOnlyConfig())
    return plain, timed()


def measure(engine: Any, batch: list[Any], rounds: int) -> tuple[float, list[Any]]:
    """(median seconds of a round, the last round's images)."""
    import numpy as np

    engine.generate(batch)  # warm-up
    times, images = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        results = engine.generate(batch)
        times.append(time.perf_counter() - start)
        for r in results:
            if r.error:
                raise RuntimeError(r.error)
        images = [np.asarray(r.image) for r in results]
    return statistics.median(times), images


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=SIZE, help="image side (default 64)")
    args = parser.parse_args()

    import numpy as np
    import torch

    from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig
    from vllm_omni_plugin.diffusion.quantization import QuantizationSpec
    from vllm_omni_plugin.tiny_models import build
    from vllm_omni_plugin.tiny_models.gguf_file import write_denoiser_gguf

    torch.set_num_threads(1)
    cache_dir = Path(os.environ.get("VLLM_OMNI_TINY_MODEL_CACHE", ROOT / ".cache" / "tiny_models"))
    int8_ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="quant-bench-") as scratch:
        print(f"{'model':<11} {'scheme':<19} {'weights':>10} {'ratio':>6} {'img/s':>7} {'speed':>6} "
              f"{'max':>4} {'mean':>5}")  # fmt: skip
        for kind in args.models:
            path = build(kind, cache_dir / kind)
            batch = requests(kind, args.batch, args.steps, args.size)
            baseline: tuple[float, list[Any], int] | None = None
            for scheme in ("none", *[s for s in args.schemes if s != "none"]):
                if scheme == "gguf" and kind == "glm-image":
                    continue
                spec = None
                if scheme == "gguf":
                    gguf = write_denoiser_gguf(path, Path(scratch) / f"{kind}-Q8_0.gguf")
                    spec = QuantizationSpec(denoiser="gguf", gguf_file=str(gguf))
                elif scheme != "none":
                    spec = QuantizationSpec.of(scheme)
                engine = DiffusionEngine(
                    path, DiffusionEngineConfig(max_batch_size=args.batch, quantization=spec)
                )
                try:
                    seconds, images = measure(engine, batch, args.rounds)
                    (denoiser,) = [w for w in engine.weights if w.name == "transformer"]
                finally:
                    engine.close()
                if baseline is None:
                    baseline = (seconds, images, denoiser.bytes)
                speed = baseline[0] / seconds
                diffs = [
                    np.abs(a.astype(np.int16) - b.astype(np.int16))
                    for a, b in zip(images, baseline[1], strict=True)
                ]
                worst = max(int(d.max()) for d in diffs)
                mean = float(np.mean([d.mean() for d in diffs]))
                if scheme == "int8_weight_only":
                    int8_ratios.append(speed)
                print(f"{kind:<11} {scheme:<19} {denoiser.bytes / 1024:>8.0f}KB "
                      f"{denoiser.bytes / baseline[2]:>6.2f} {args.batch / seconds:>7.2f} {speed:>5.2f}x "
                      f"{worst:>4} {mean:>5.2f}", flush=True)  # fmt: skip
    if int8_ratios:
        worst_speed = min(int8_ratios)
        verdict = "met" if worst_speed >= INT8_TARGET else "NOT met"
        print(
            f"int8_weight_only over unquantized: worst {worst_speed:.2f}x (target {INT8_TARGET}x: {verdict})"
        )
    print("linear layers alone (a feed-forward pair, up and down; int8_weight_only over float32):")
    for tokens, width, inner in LINEAR_SHAPES:
        plain, quantized = linear_pair_seconds(tokens, width, inner)
        print(f"  {tokens:>4} tokens, {width:>4} -> {inner:>4} -> {width:>4}: float32 {plain * 1e3:8.3f} ms, "
              f"int8 {quantized * 1e3:8.3f} ms, {plain / quantized:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
