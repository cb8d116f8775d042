"""The README demo: serve the tiny GLM-Image with `vllm serve ... --omni` (the stock `vllm` console
script), generate one image with the official `openai` client, write it as a PNG, stop the server."""

from __future__ import annotations

import base64
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    import openai

    from vllm_omni_plugin.tiny_models import build
    from vllm_omni_testkit.harness.server import ServerProcess, bin_script, cpu_test_env, free_port

    cache = Path(os.environ.get("VLLM_OMNI_TINY_MODEL_CACHE", ROOT / ".cache" / "tiny_models"))
    model = build("glm-image", cache / "glm-image")
    out = Path(os.environ.get("VLLM_OMNI_DEMO_OUT", ROOT / "out" / "demo.png"))
    port = free_port()
    argv = [
        bin_script("vllm"), "serve", str(model), "--omni",
        "--deploy-config", str(ROOT / "deploy" / "tiny_glm_image_cpu.yaml"),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    log = ROOT / "out" / "demo_server.log"
    print("== " + " ".join(argv[1:]), flush=True)
    print(f"   (server log: {log})", flush=True)
    # The test environment less its one OpenMP thread: the CPU threads policy splits this machine's cores
    # between the AR stage and the DiT (docs/cpu.md, "CPU threads"), unless OMP_NUM_THREADS is set here.
    threads = os.environ.get("OMP_NUM_THREADS")
    env = cpu_test_env({"OMP_NUM_THREADS": threads}) if threads else cpu_test_env(drop=("OMP_NUM_THREADS",))
    server = ServerProcess(argv, port=port, log_path=log, env=env)
    server.start()
    try:
        start = time.perf_counter()
        server.wait_ready(timeout=600)
        print(f"== server ready in {time.perf_counter() - start:.0f}s; asking for one image", flush=True)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        t0 = time.perf_counter()
        result = client.images.generate(
            model=str(model), prompt="a red fox in the snow", size="64x64", response_format="b64_json"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(base64.b64decode(result.data[0].b64_json))
        print(f"== wrote {out} ({out.stat().st_size} bytes) in {time.perf_counter() - t0:.1f}s", flush=True)
    finally:
        code = server.stop()
        print(f"== server stopped (exit code {code})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
