"""HTTP images/s at concurrency 16 (`vllm serve --omni`, official openai client) vs the offline API
at the same concurrency, in the same run, on the tiny GLM-Image.

    python benchmarks/http_throughput.py [--model DIR] [--images 32] [--concurrency 16]

Target: HTTP >= 0.95x the offline API.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = str(ROOT / "deploy" / "tiny_glm_image_cpu.yaml")
SIZE, STEPS = 64, 4


async def http_rate(base_url: str, model: str, images: int, concurrency: int) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            await client.images.generate(
                model=model,
                prompt=f"a red fox number {i}",
                size=f"{SIZE}x{SIZE}",
                response_format="b64_json",
                extra_body={"seed": i, "num_inference_steps": STEPS},
            )

    await asyncio.gather(*(one(i) for i in range(concurrency)))  # warm-up
    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(images)))
    return images / (time.perf_counter() - start)


def offline_rate(model: str, images: int, concurrency: int) -> float:
    from concurrent.futures import wait

    from vllm_omni_plugin.entrypoints.omni import Omni
    from vllm_omni_plugin.stage.orchestrator import OmniRequest

    def req(i: int) -> OmniRequest:
        return OmniRequest(
            prompt=f"a red fox number {i}", height=SIZE, width=SIZE, num_inference_steps=STEPS, seed=i
        )

    with Omni(model, deploy_config=DEPLOY) as omni:
        omni.generate([req(i) for i in range(concurrency)])  # warm-up
        start = time.perf_counter()
        pending: set = set()
        for i in range(images):  # keep `concurrency` requests in flight, like the HTTP clients
            if len(pending) >= concurrency:
                _, pending = wait(pending, return_when="FIRST_COMPLETED")
            pending.add(omni.submit(req(i)))
        wait(pending)
        return images / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    from vllm_omni_plugin.testing.server import ServerProcess, bin_script, cpu_test_env, free_port
    from vllm_omni_plugin.testing.tiny_models import build

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
    print(f"{'HTTP (openai client)':<28} {http:>9.2f}")
    print(f"ratio HTTP/offline: {http / offline:.3f}  (target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
