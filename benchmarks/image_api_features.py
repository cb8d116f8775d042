"""What streaming and LoRA adapters cost, each against the same requests without them, in one run.

    python benchmarks/image_api_features.py [--repeats 5] [--steps 28] [--adapters 4] [--requests 16]

(a) Streaming: one 28-step 64x64 request at a time, streamed with ``partial_images=3`` against the same
    request not streamed (median of ``--repeats``), on the tiny SD3 and the tiny GLM-Image (whose AR stage
    reports progress first): time to the first event, to the first preview, and the total. Target: the
    stream's total <= 1.10x the unstreamed one.
(b) LoRA: 16 concurrent requests to the tiny SD3 spread over 4 adapters (and so batched across adapters)
    against the same 16 requests without an adapter: images/s. Target: >= 0.8x.

Real servers (``vllm serve --omni``) on this machine, a thin httpx client reading the server-sent events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
SIZE = 64
DIFFUSION_DEPLOY = (
    "pipeline: diffusion\nstages:\n  - stage_id: 0\n    max_batch_size: 16\n    max_loras: {loras}\n"
)


async def streamed(client: Any, body: dict) -> tuple[float, float | None, float]:
    """(first event, first preview, total) seconds of one streamed request."""
    start = time.perf_counter()
    first = preview = None
    async with client.stream("POST", "/v1/images/generations", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter() - start
            first = first if first is not None else now
            kind = json.loads(line[6:]).get("type", "")
            if kind.endswith("partial_image") and preview is None:
                preview = now
            if kind.endswith("completed"):
                return first, preview, now
    raise RuntimeError("the stream ended without a completed event")


async def streaming_case(base_url: str, steps: int, repeats: int) -> dict[str, float]:
    import httpx

    body = {
        "prompt": "a lighthouse at dusk",
        "size": f"{SIZE}x{SIZE}",
        "num_inference_steps": steps,
        "seed": 1,
    }
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await client.post("/v1/images/generations", json=body)  # warm-up
        plain, stream, first, preview = [], [], [], []
        for _ in range(repeats):
            start = time.perf_counter()
            response = await client.post("/v1/images/generations", json=body)
            response.raise_for_status()
            plain.append(time.perf_counter() - start)
            f, p, total = await streamed(client, {**body, "stream": True, "partial_images": 3})
            stream.append(total)
            first.append(f)
            preview.append(p if p is not None else float("nan"))
    return {
        "plain": statistics.median(plain),
        "stream": statistics.median(stream),
        "first_event": statistics.median(first),
        "first_preview": statistics.median(preview),
    }


async def lora_case(base_url: str, adapters: int, requests: int, repeats: int) -> tuple[float, float]:
    import httpx

    def body(i: int, lora: bool) -> dict:
        fields = {"prompt": f"a lantern {i}", "size": f"{SIZE}x{SIZE}", "num_inference_steps": 8, "seed": i}
        return {**fields, "lora": f"style{i % adapters}"} if lora else fields

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def rate(lora: bool) -> float:
            start = time.perf_counter()
            answers = await asyncio.gather(
                *(client.post("/v1/images/generations", json=body(i, lora)) for i in range(requests))
            )
            for answer in answers:
                answer.raise_for_status()
            return requests / (time.perf_counter() - start)

        await rate(True)  # warm-up: every adapter loaded
        await rate(False)
        with_lora = [await rate(True) for _ in range(repeats)]
        without = [await rate(False) for _ in range(repeats)]
    return statistics.median(with_lora), statistics.median(without)


def main() -> int:
    from vllm_omni_plugin.tiny_models.builders import build
    from vllm_omni_plugin.tiny_models.lora import build_lora
    from vllm_omni_testkit.harness.server import ServerProcess, bin_script, cpu_test_env, free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args()
    cache = ROOT / ".cache" / "tiny_models"
    sd3, glm = build("sd3", cache / "sd3"), build("glm-image", cache / "glm-image")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        deploy = work / "diffusion.yaml"
        deploy.write_text(DIFFUSION_DEPLOY.format(loras=args.adapters))
        modules = [f"style{i}={build_lora(sd3, work / f'style{i}', seed=i)}" for i in range(args.adapters)]

        def serve(model: Path, deploy_file: Path, *extra: str) -> ServerProcess:
            port = free_port()
            argv = [bin_script("vllm"), "serve", str(model), "--omni", "--deploy-config", str(deploy_file),
                    "--port", str(port), "--host", "127.0.0.1", *extra]  # fmt: skip
            return ServerProcess(argv, port=port, env=cpu_test_env(), log_path=work / f"{model.name}.log")

        results = {}
        with serve(sd3, deploy, "--lora-modules", *modules) as server:
            server.wait_ready(timeout=600)
            results["sd3"] = asyncio.run(streaming_case(server.base_url, args.steps, args.repeats))
            lora, plain = asyncio.run(lora_case(server.base_url, args.adapters, args.requests, args.repeats))
        with serve(glm, ROOT / "deploy" / "tiny_glm_image_cpu.yaml") as server:
            server.wait_ready(timeout=600)
            results["glm-image"] = asyncio.run(streaming_case(server.base_url, args.steps, args.repeats))

    print(f"(a) streaming, {args.steps} steps, partial_images=3, {SIZE}x{SIZE}, median of {args.repeats}")
    print(f"{'model':<10} {'unstreamed s':>13} {'streamed s':>11} {'ratio':>6} {'first event s':>14} "
          f"{'first preview s':>16}")  # fmt: skip
    worst = 0.0
    for model, r in results.items():
        ratio = r["stream"] / r["plain"]
        worst = max(worst, ratio)
        print(f"{model:<10} {r['plain']:>13.3f} {r['stream']:>11.3f} {ratio:>6.2f} {r['first_event']:>14.3f} "
              f"{r['first_preview']:>16.3f}")  # fmt: skip
    print(f"(b) LoRA: {args.requests} concurrent requests over {args.adapters} adapters vs none (tiny SD3)")
    print(f"with adapters {lora:.2f} img/s, without {plain:.2f} img/s, ratio {lora / plain:.2f}")
    ok = worst <= 1.10 and lora / plain >= 0.8
    verdict = "met" if ok else "MISSED"
    print(f"targets: streaming <= 1.10x ({worst:.2f}x), LoRA >= 0.8x ({lora / plain:.2f}x): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
