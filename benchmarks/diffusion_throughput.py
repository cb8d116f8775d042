"""A diffusers pipeline served as one diffusion stage vs the same pipeline called directly, in one run:
tiny SD3, 64x64, 4 steps (guidance: the pipeline's default, so classifier-free guidance is on).

    python benchmarks/diffusion_throughput.py [--model DIR] [--images 48] [--concurrency 1 8 16]
                                              [--max-batch-size 16]

Baseline: diffusers' ``StableDiffusion3Pipeline`` called once per image, one after the other (what a
service built on diffusers alone does); for reference, the same pipeline called with 16 prompts at once
(what batching can give at most on the machine, with nothing around it). Then the offline API (``Omni``)
and the HTTP server (``vllm serve --omni``, measured by ``vllm bench serve --omni``) with 1, 8 and 16
requests in flight; the stage batches up to 16 (``diffusion.yaml`` with ``max_batch_size: 16``). Each
figure is the median of a few timed rounds after a warm-up; ratios are against the sequential baseline,
and HTTP against offline at the same concurrency.

Targets: at concurrency 16 >= 3x the sequential baseline (the DiT batches); HTTP >= 0.95x offline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
SIZE, STEPS = 64, 4
ROUNDS = 3
DEPLOY = """\
pipeline: diffusion
stages:
  - stage_id: 0
    max_batch_size: {max_batch_size}
"""


def prompt(i: int) -> str:
    return f"a red fox number {i} in the snow"


def diffusers_rates(model: str, images: int, batch: int) -> tuple[float, float]:
    """Diffusers alone: one ``__call__`` per image (the baseline), and calls of ``batch`` prompts with one
    generator each (what batching can give at most on this machine, with no serving around it)."""
    import diffusers
    import torch

    from vllm_omni_testkit.reference.diffusers import pipeline_class

    pipe = getattr(diffusers, pipeline_class(model)).from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def call(first: int, count: int) -> None:
        generators = [torch.Generator("cpu").manual_seed(i) for i in range(first, first + count)]
        prompts = [prompt(i) for i in range(first, first + count)]
        pipe(prompts, height=SIZE, width=SIZE, num_inference_steps=STEPS, generator=generators)

    def rate(per_call: int) -> float:
        call(0, per_call)  # warm-up
        rates = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for first in range(0, images, per_call):
                call(first, min(per_call, images - first))
            rates.append(images / (time.perf_counter() - start))
        return statistics.median(rates)

    return rate(1), rate(batch)


def offline_rates(model: str, deploy: str, images: int, levels: list[int]) -> dict[int, float]:
    from vllm_omni_plugin.entrypoints.omni import Omni
    from vllm_omni_plugin.stage.orchestrator import OmniRequest
    from vllm_omni_testkit.harness.load import in_flight

    def req(i: int) -> OmniRequest:
        return OmniRequest(prompt=prompt(i), height=SIZE, width=SIZE, num_inference_steps=STEPS, seed=i)

    out = {}
    with Omni(model, deploy_config=deploy) as omni:
        omni.generate([req(i) for i in range(max(levels))])  # warm-up
        for concurrency in levels:
            rates = []
            for _ in range(ROUNDS):
                start = time.perf_counter()
                in_flight(omni, (req(i) for i in range(images)), concurrency)  # as the HTTP clients
                rates.append(images / (time.perf_counter() - start))
            out[concurrency] = statistics.median(rates)
    return out


def http_rates(base_url: str, model: str, images: int, levels: list[int]) -> dict[int, float]:
    """``vllm bench serve --omni``'s measurement at each concurrency (a thin httpx client: it shares the
    CPU with the stage): the median images/s of ``ROUNDS`` runs, after a warm-up."""
    from vllm_omni_plugin.bench.serve import measure

    out = {}
    for concurrency in levels:
        rates = []
        for round_ in range(ROUNDS):
            warmups = max(levels) if (concurrency, round_) == (levels[0], 0) else 0
            result = measure(
                ["--base-url", base_url, "--model", model, "--num-prompts", str(images), "--max-concurrency",
                 str(concurrency), "--size", f"{SIZE}x{SIZE}", "--num-inference-steps", str(STEPS),
                 "--seed", str(round_ * images), "--num-warmups", str(warmups)]
            )  # fmt: skip
            if result["failed"]:
                raise RuntimeError(f"{result['failed']} requests failed: {result['errors'][:1]}")
            rates.append(result["image_throughput"])
        out[concurrency] = statistics.median(rates)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a diffusers directory (default: the tiny SD3)")
    parser.add_argument("--images", type=int, default=48, help="images per timed round")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--max-batch-size", type=int, default=16, help="the stage's max_batch_size")
    args = parser.parse_args()
    from vllm_omni_plugin.tiny_models import build
    from vllm_omni_testkit.harness.server import ServerProcess, bin_script, cpu_test_env, free_port

    model = args.model or str(build("sd3", ROOT / ".cache" / "tiny_models" / "sd3"))
    levels = sorted(args.concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        deploy = str(Path(tmp) / "diffusion_bench.yaml")
        Path(deploy).write_text(DEPLOY.format(max_batch_size=args.max_batch_size))
        sequential, batched = diffusers_rates(model, args.images, levels[-1])
        offline = offline_rates(model, deploy, args.images, levels)
        port = free_port()
        argv = [bin_script("vllm"), "serve", model, "--omni", "--deploy-config", deploy,
                "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        with ServerProcess(
            argv, port=port, log_path=ROOT / "out" / "bench_diffusion_server.log", env=cpu_test_env()
        ) as server:
            server.wait_ready(timeout=600)
            http = http_rates(server.base_url, model, args.images, levels)
    print(
        f"\nmodel={model} size={SIZE} steps={STEPS} max_batch_size={args.max_batch_size} "
        f"images/round={args.images} rounds={ROUNDS} (median)"
    )
    rows = [
        ("diffusers, sequential calls", sequential, None),
        (f"diffusers, calls of {levels[-1]} prompts", batched, None),
    ]
    for concurrency in levels:
        rows.append((f"offline API, concurrency {concurrency}", offline[concurrency], None))
        rows.append((f"HTTP, concurrency {concurrency}", http[concurrency], offline[concurrency]))
    print(f"{'runner':<34} {'images/s':>9} {'x sequential':>13} {'HTTP/offline':>13}")
    for name, rate, against in rows:
        versus = f"{rate / against:>13.3f}" if against else ""
        print(f"{name:<34} {rate:>9.2f} {rate / sequential:>13.2f} {versus}")
    top = levels[-1]
    print(
        f"targets at concurrency {top}: >= 3x sequential (offline {offline[top] / sequential:.2f}x, "
        f"HTTP {http[top] / sequential:.2f}x); HTTP >= 0.95x offline ({http[top] / offline[top]:.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
