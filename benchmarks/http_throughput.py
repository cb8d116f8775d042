"""HTTP images/s at concurrency 16 (`vllm serve --omni`, official openai client) vs the offline API
at the same concurrency, in the same run, on the tiny GLM-Image.

    python benchmarks/http_throughput.py [--model DIR] [--images 32] [--concurrency 16]

Target: HTTP >= 0.95x the offline API.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = str(ROOT / "deploy" / "tiny_glm_image_cpu.yaml")
SIZE, STEPS = 64, 4
ROUNDS = 3  # timed rounds per side (median reported)


def http_rate(base_url: str, model: str, images: int, concurrency: int) -> float:
    """``vllm bench serve --omni``'s measurement (a thin httpx client: on a 2-core machine the client
    shares the CPU with every stage, so a heavy client would measure itself rather than the server; the
    end-to-end tests use the official openai client): the median images/s of ``ROUNDS`` runs."""
    from vllm_omni_plugin.bench.serve import measure

    rates = []
    for round_ in range(ROUNDS):
        result = measure(
            ["--base-url", base_url, "--model", model, "--num-prompts", str(images), "--max-concurrency",
             str(concurrency), "--size", f"{SIZE}x{SIZE}", "--num-inference-steps", str(STEPS), "--seed",
             str(round_ * images), "--num-warmups", str(concurrency if round_ == 0 else 0)]
        )  # fmt: skip
        if result["failed"]:
            raise RuntimeError(f"{result['failed']} requests failed: {result['errors'][:1]}")
        rates.append(result["image_throughput"])
    return statistics.median(rates)


def offline_rate(model: str, images: int, concurrency: int) -> float:
    from vllm_omni_plugin.entrypoints.omni import Omni
    from vllm_omni_plugin.stage.orchestrator import OmniRequest
    from vllm_omni_testkit.harness.load import in_flight

    def req(i: int) -> OmniRequest:
        return OmniRequest(
            prompt=f"a red fox number {i}", height=SIZE, width=SIZE, num_inference_steps=STEPS, seed=i
        )

    with Omni(model, deploy_config=DEPLOY) as omni:
        omni.generate([req(i) for i in range(concurrency)])  # warm-up
        rates = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            in_flight(omni, (req(i) for i in range(images)), concurrency)  # as the HTTP clients
            rates.append(images / (time.perf_counter() - start))
        return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    from vllm_omni_plugin.tiny_models import build
    from vllm_omni_testkit.harness.server import ServerProcess, bin_script, cpu_test_env, free_port

    model = args.model or str(build("glm-image", ROOT / ".cache" / "tiny_models" / "glm-image"))
    port = free_port()
    argv = [bin_script("vllm"), "serve", model, "--omni", "--deploy-config", DEPLOY,
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with ServerProcess(
        argv, port=port, log_path=ROOT / "out" / "bench_server.log", env=cpu_test_env()
    ) as server:
        server.wait_ready(timeout=600)
        http = http_rate(server.base_url, model, args.images, args.concurrency)
    offline = offline_rate(model, args.images, args.concurrency)
    print(f"\nmodel={model} size={SIZE} steps={STEPS} images={args.images} concurrency={args.concurrency}")
    print(f"{'runner':<28} {'images/s':>9}")
    print(f"{'offline API (Omni)':<28} {offline:>9.2f}")
    print(f"{'HTTP (vllm bench serve)':<28} {http:>9.2f}")
    print(f"ratio HTTP/offline: {http / offline:.3f}  (target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
