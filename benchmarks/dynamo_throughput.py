"""Images/s through NVIDIA Dynamo's frontend (its Rust HTTP service, our pipeline-role worker behind it)
against our own `vllm serve --omni`, at concurrency 1 and 8, on the tiny GLM-Image, in the same run.

    python benchmarks/dynamo_throughput.py [--model DIR] [--rounds 3] [--images 16]

Both deployments run the same deploy file side by side; each round measures one and then the other
(the order alternating), so load from elsewhere on the machine falls on both alike; medians are
reported. Target: Dynamo >= 0.9x `vllm serve --omni` at each concurrency.
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
MODEL_NAME = "tiny-glm-image"
SIZE, STEPS = 64, 4
CONCURRENCY = (1, 8)


def body(i: int, dynamo: bool) -> dict:
    """One request as each front end takes it (Dynamo: the diffusion knobs in ``nvext``)."""
    knobs = {"seed": i, "num_inference_steps": STEPS}
    request = {"model": MODEL_NAME, "prompt": f"a red fox number {i}", "size": f"{SIZE}x{SIZE}"}
    return {**request, "nvext": knobs} if dynamo else {**request, **knobs}


async def rate(base_url: str, dynamo: bool, images: int, concurrency: int) -> float:
    """Images/s of ``images`` requests kept ``concurrency`` in flight (httpx: a thin client, since on a
    small machine it shares the CPU with the stages; the bodies are checked, not decoded)."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def one(i: int) -> None:
            async with gate:
                response = await client.post("/v1/images/generations", json=body(i, dynamo))
                if response.status_code != 200 or b'"b64_json"' not in response.content:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(images)))
        return images / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--images", type=int, default=16, help="requests per round at concurrency 1 (x3 at 8)"
    )
    args = parser.parse_args()
    from vllm_omni_plugin.tiny_models import build
    from vllm_omni_testkit.harness.dynamo import DynamoSite, dynamo_missing
    from vllm_omni_testkit.harness.server import ServerProcess, bin_script, cpu_test_env, free_port

    if missing := dynamo_missing():
        print(f"error: {missing}", file=sys.stderr)
        return 2
    model = args.model or str(build("glm-image", ROOT / ".cache" / "tiny_models" / "glm-image"))
    out = ROOT / "out" / "dynamo_throughput"
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [bin_script("vllm"), "serve", model, "--omni", "--deploy-config", DEPLOY, "--served-model-name",
            MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    ours = ServerProcess(argv, port=port, log_path=out / "vllm_serve.log", env=cpu_test_env()).start()
    site = DynamoSite(out)
    try:
        frontend = site.frontend()
        worker = site.worker(
            model, "--deploy-config", DEPLOY, "--served-model-name", MODEL_NAME, name="worker"
        )
        ours.wait_ready(timeout=900)
        frontend.wait_ready(path="/v1/models", timeout=120)
        worker.wait_for_log("as Dynamo model", timeout=900)
        frontend.wait_until(lambda: MODEL_NAME in httpx_get(frontend.base_url + "/v1/models"), 120)
        sides = {
            "vllm serve --omni": (ours.base_url, False),
            "Dynamo frontend + worker": (frontend.base_url, True),
        }
        for url, dynamo in sides.values():  # warm-up
            asyncio.run(rate(url, dynamo, 8, 8))
        results: dict[tuple[str, int], list[float]] = {}
        for concurrency in CONCURRENCY:
            images = args.images * (3 if concurrency > 1 else 1)
            for n in range(args.rounds):
                order = list(sides.items()) if n % 2 == 0 else list(reversed(sides.items()))
                for name, (url, dynamo) in order:
                    results.setdefault((name, concurrency), []).append(
                        asyncio.run(rate(url, dynamo, images, concurrency))
                    )
    finally:
        site.stop()
        ours.stop()
    print(f"\nmodel={model} size={SIZE} steps={STEPS} rounds={args.rounds} (median images/s)")
    print(f"{'front end':<28}" + "".join(f"{'c=' + str(c):>10}" for c in CONCURRENCY))
    for name in sides:
        print(f"{name:<28}" + "".join(f"{statistics.median(results[(name, c)]):>10.2f}" for c in CONCURRENCY))
    names = list(sides)
    for c in CONCURRENCY:
        ratio = statistics.median(results[(names[1], c)]) / statistics.median(results[(names[0], c)])
        print(f"ratio Dynamo / vllm serve --omni at concurrency {c}: {ratio:.3f}  (target >= 0.9)")
    return 0


def httpx_get(url: str) -> str:
    import httpx

    return httpx.get(url, timeout=5).text


if __name__ == "__main__":
    sys.exit(main())
