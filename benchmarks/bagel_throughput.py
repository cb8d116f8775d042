"""Images/s of the tiny BAGEL: the independent single-process reference
(``vllm_omni_testkit/reference/bagel.py``, BAGEL's ``interleave_inference``) run sequentially vs our
two-stage deployment (the thinker in a vLLM engine, the DiT in a StageDiffusionCoreProc, contexts over
shared memory) at concurrency 1, 4 and 8, in the same run; the KV bytes each request hands over and the
handoff time (the context's copy out of the paged cache and its put, plus the DiT's get), and the handoff
projected for BAGEL-7B-MoT.

    python benchmarks/bagel_throughput.py [--model DIR] [--images 16] [--size 64] [--steps 8]

Requests alternate text-to-image and image edits. Targets: >= 2x the reference at concurrency 8; handoff
<= 2% of the end-to-end time at concurrency 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEPLOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deploy", "tiny_bagel_cpu.yaml")
T2I = {"cfg_text_scale": 4.0, "cfg_img_scale": 1.0, "cfg_interval": (0.4, 1.0), "cfg_renorm_type": "global"}
EDIT = {
    "cfg_text_scale": 4.0,
    "cfg_img_scale": 2.0,
    "cfg_interval": (0.0, 1.0),
    "cfg_renorm_type": "text_channel",
}

# BAGEL-7B-MoT: 28 layers x (K, V) x 4 KV heads x 128 dims x 2 bytes (bf16) per context token.
BAGEL_7B_BYTES_PER_TOKEN = 28 * 2 * 4 * 128 * 2


def source_image(i: int, size: int) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(i)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def work(i: int, size: int) -> tuple[str, Any]:
    return (
        (f"a red fox number {i}", None) if i % 2 == 0 else (f"make picture {i} blue", source_image(i, size))
    )


def reference(model: str, n: int, size: int, steps: int) -> float:
    from vllm_omni_testkit.reference.bagel import BagelReference

    ref = BagelReference(model)

    def one(i: int) -> None:
        prompt, image = work(i, size)
        inputs = [prompt] if image is None else [image, prompt]
        params = T2I if image is None else EDIT
        ref.interleave(inputs, height=size, width=size, seed=i, num_inference_steps=steps, **params)

    one(0)  # warm-up
    start = time.perf_counter()
    for i in range(n):
        one(i)
    return n / (time.perf_counter() - start)


def ours(
    model: str, concurrencies: list[int], n: int, size: int, steps: int
) -> tuple[dict[int, float], dict]:
    from vllm_omni_plugin.entrypoints.omni import Omni
    from vllm_omni_plugin.stage.orchestrator import OmniRequest
    from vllm_omni_testkit.harness.load import in_flight

    def requests(total: int) -> list[OmniRequest]:
        out = []
        for i in range(total):
            prompt, image = work(i, size)
            out.append(
                OmniRequest(
                    prompt=prompt,
                    images=[image] if image is not None else [],
                    height=size,
                    width=size,
                    num_inference_steps=steps,
                    seed=i,
                )
            )
        return out

    rates: dict[int, float] = {}
    handoff: dict[str, list[float]] = {"bytes": [], "seconds": [], "fraction": []}
    with Omni(model, deploy_config=DEPLOY) as omni:
        omni.generate(requests(2))  # warm-up
        for concurrency in concurrencies:
            total = max(n, concurrency)
            batch = requests(total)
            start = time.perf_counter()
            results = in_flight(omni, batch, concurrency)
            rates[concurrency] = total / (time.perf_counter() - start)
            keys = ("stage_0", "stage_1", "stage_1_denoise", "stage_1_decode", "total")
            means = {k: statistics.mean(r.timings.get(k, 0.0) for r in results) * 1e3 for k in keys}
            print(
                f"concurrency {concurrency}: mean ms " + ", ".join(f"{k} {v:.1f}" for k, v in means.items())
            )
            failed = [r.error for r in results if not r.ok]
            if failed:
                raise SystemExit(f"requests failed: {failed[:3]}")
            if concurrency == 1:
                for result in results:
                    kv_bytes, seconds = handoff_of(result)
                    handoff["bytes"].append(kv_bytes)
                    handoff["seconds"].append(seconds)
                    handoff["fraction"].append(seconds / result.timings["total"])
    return rates, handoff


def handoff_of(result: Any) -> tuple[int, float]:
    """KV bytes a request handed over (its contexts) and the seconds that took: the exports in the
    thinker's worker plus the DiT's get."""
    from vllm_omni_plugin.connectors.base import HANDLE_KEY

    thinker = result.stage_outputs[0]
    outputs = [thinker, *thinker.companions.values()]
    contexts = [o.stage_outputs["context"] for o in outputs]
    kv_bytes = sum(int(c["kv"][HANDLE_KEY]["nbytes"]) for c in contexts)
    seconds = max(c["export_s"] for c in contexts) + result.timings.get("stage_1_transfer_in", 0.0)
    return kv_bytes, seconds


def shm_seconds(nbytes: int, repeats: int = 3) -> float:
    """Median put + get of one ``nbytes`` tensor through the shared-memory connector (one process)."""
    import torch

    from vllm_omni_plugin.connectors.base import make_connector

    value = torch.empty(nbytes // 2, dtype=torch.bfloat16).fill_(1)
    times = []
    with make_connector(
        "bench", "SharedMemoryConnector", {"pool_bytes": 2 * nbytes + (64 << 20)}
    ) as connector:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            got = connector.get(connector.put(value))
            got.sum()  # touch it
            times.append(time.perf_counter() - start)
            del got
    return statistics.median(times[1:])


def bagel_7b_edit_tokens(size: int = 512, text_tokens: int = 24) -> tuple[int, int]:
    """Context tokens of a 512x512 edit on BAGEL-7B-MoT: cond (VAE block, ViT block, text) and the
    cfg_img companion (text); cfg_text is a prefix of cond and does not travel."""
    from vllm_omni_plugin.models.bagel.config import VAE_TRANSFORM_DEFAULT, VIT_TRANSFORM_DEFAULT
    from vllm_omni_plugin.models.bagel.transforms import resized_size

    width, height = resized_size(size, size, VAE_TRANSFORM_DEFAULT)
    vit_w, vit_h = resized_size(width, height, VIT_TRANSFORM_DEFAULT)
    cond = (height // 16) * (width // 16) + 2 + (vit_h // 14) * (vit_w // 14) + 2 + text_tokens
    return cond, text_tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="tiny BAGEL directory (built when omitted)")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from vllm_omni_plugin.tiny_models import build

        model = str(build("bagel", os.path.join(".cache", "tiny_models", "bagel")))

    base = reference(model, args.images, args.size, args.steps)
    rates, handoff = ours(model, [1, 4, 8], args.images, args.size, args.steps)
    print(
        f"tiny BAGEL, {args.size}x{args.size}, {args.steps} steps, t2i and edits alternating, "
        f"{args.images} images"
    )
    print(f"{'':24} {'images/s':>9} {'x reference':>12}")
    print(f"{'reference, sequential':24} {base:9.2f} {1.0:12.2f}")
    for concurrency, rate in rates.items():
        print(f"{f'ours, concurrency {concurrency}':24} {rate:9.2f} {rate / base:12.2f}")
    p50 = statistics.median(handoff["seconds"])
    print(
        f"KV handed over per request: {statistics.mean(handoff['bytes']) / 1024:.1f} KiB mean; handoff p50 "
        f"{p50 * 1e3:.2f} ms = {statistics.median(handoff['fraction']) * 100:.2f}% of the end-to-end time "
        "at concurrency 1 (target <= 2%)"
    )
    cond, companion = bagel_7b_edit_tokens()
    nbytes = (cond + companion) * BAGEL_7B_BYTES_PER_TOKEN
    seconds = shm_seconds(cond * BAGEL_7B_BYTES_PER_TOKEN) + shm_seconds(companion * BAGEL_7B_BYTES_PER_TOKEN)
    print(
        f"BAGEL-7B-MoT 512x512 edit: {cond} + {companion} context tokens = {nbytes / 2**20:.0f} MiB of "
        "bf16 K/V; "
        f"shared memory measured here moves that in {seconds * 1e3:.0f} ms "
        f"({nbytes / seconds / 1e9:.1f} GB/s)"
    )
    print(f"target >= 2x the reference at concurrency 8: {'met' if rates[8] / base >= 2 else 'NOT met'}")


if __name__ == "__main__":
    main()
