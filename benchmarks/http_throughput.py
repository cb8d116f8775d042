"""HTTP images/s at concurrency 16 (`vllm serve --omni`, official openai client) vs the offline API
at the same concurrency, in the same run, on the tiny GLM-Image.

    python benchmarks/http_throughput.py [--model DIR] [--images 32] [--concurrency 16]

Target: HTTP >= 0.95x the offline API.
"""

from __future__ import annotations

import argparse
import asyncio
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


async def http_rate(base_url: str, model: str, images: int, concurrency: int) -> float:
    """A thin HTTP client (httpx, the bodies are checked, not decoded): on a 2-core machine the client
    shares the CPU with every stage, so a heavy client would measure itself rather than the server.
    The end-to-end tests use the official openai client."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def one(i: int) -> None:
            async with gate:
                response = await client.post(
                    "/v1/images/generations",
                    json={
                        "model": model,
                        "prompt": f"a red fox number {i}",
                        "size": f"{SIZE}x{SIZE}",
                        "response_format": "b64_json",
                        "seed": i,
                        "num_inference_steps": STEPS,
                    },
                )
                if response.status_code != 200 or b'"b64_json"' not in response.content:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")

        await asyncio.gather(*(one(i) for i in range(concurrency)))  # warm-up
        rates = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(images)))
            rates.append(images / (time.perf_counter() - start))
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
        http = asyncio.run(http_rate(server.base_url, model, args.images, args.concurrency))
    offline = offline_rate(model, args.images, args.concurrency)
    print(f"\nmodel={model} size={SIZE} steps={STEPS} images={args.images} concurrency={args.concurrency}")
    print(f"{'runner':<28} {'images/s':>9}")
    print(f"{'offline API (Omni)':<28} {offline:>9.2f}")
    print(f"{'HTTP (httpx client)':<28} {http:>9.2f}")
    print(f"ratio HTTP/offline: {http / offline:.3f}  (target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
