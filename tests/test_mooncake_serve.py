"""Seed 004's BAGEL deploy file (vllm-omni's, in tests/data) with its context edge on Mooncake's
transfer engine: changed only in ``from_stage_0: rdma_connector`` and ``protocol: "tcp"`` (this host has no
RDMA device), served through the stock ``vllm`` script, against the same file over shared memory.
Real servers, the tiny random-weight BAGEL, real HTTP."""

from __future__ import annotations

import base64
import io
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import our_segments_left
from vllm_omni_plugin.connectors.mooncake import mooncake_missing
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.leaks import LeakWatch
from vllm_omni_testkit.harness.server import (
    ServerProcess,
    bin_script,
    free_port,
    left_in_temp,
    metric_value,
    user_like_env,
)

pytestmark = pytest.mark.server

SEED_DOCUMENT = Path(__file__).resolve().parent / "data" / "bagel_vllm_omni_deploy.yaml"


def png(width: int = 64, height: int = 48) -> bytes:
    rng = np.random.default_rng(0)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


SEED_REQUEST = {
    "messages": [
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "<|im_start|>Turn the main subject into a polished gold sculpture.<|im_end|>",
                },
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64," + base64.b64encode(png()).decode()},
                },
            ],
        }
    ],
    "modalities": ["image"],
    "height": 512,
    "width": 512,
    "num_inference_steps": 6,
    "seed": 42,
}
"""The request of seed 004 (vllm-omni's stage proc/client refactor), as its curl sends it."""


def mooncake_document() -> str:
    text = SEED_DOCUMENT.read_text()
    changed = text.replace("from_stage_0: shared_memory_connector", "from_stage_0: rdma_connector").replace(
        'protocol: "rdma"', 'protocol: "tcp"'
    )
    assert changed.count("rdma_connector") == 2 and 'protocol: "tcp"' in changed
    return changed


def serve_seed_request(model: Path, document: str, directory: Path) -> tuple[np.ndarray, ServerProcess, str]:
    """The seed request's image from a server of ``document``, and the server's /metrics afterwards."""
    deploy = directory / "bagel.yaml"
    deploy.write_text(document)
    port = free_port()
    # The seed's file sizes nothing for a CPU: the KV cache size comes from vLLM's CPU variable, so vLLM's
    # profiling of the thinker's image encoder (93 images of the largest size in bf16, minutes on a CPU
    # without bf16 units, more with both servers and another worker's on two cores) decides nothing here.
    argv = [bin_script("vllm"), "serve", str(model), "--omni", "--deploy-config", str(deploy),
            "--port", str(port), "--host", "127.0.0.1", "--skip-mm-profiling"]  # fmt: skip
    env = user_like_env({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOG_STATS_INTERVAL": "1"})
    server = ServerProcess(argv, port=port, env=env, log_path=directory / "server.log")
    with server:
        assert server.proc is not None
        watch = LeakWatch(root=server.proc.pid).start()
        server.wait_ready(timeout=300)
        response = http_client.post(server.base_url + "/v1/chat/completions", json=SEED_REQUEST, timeout=300)
        assert response.status_code == 200, response.text
        url = response.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
        # The thinker's exported context was read by the DiT and released at its owner.
        deadline = time.monotonic() + 60
        while True:
            metrics = http_client.get(server.base_url + "/metrics", timeout=10).text
            if metric_value(metrics, "omni_context_export_outstanding") == 0 and metric_value(
                metrics, "omni_context_exports_total"
            ):
                break
            assert time.monotonic() < deadline, "the exported context was never released"
            time.sleep(0.2)
        # a user's stop (SIGTERM, as systemd or Kubernetes sends it): exit 0, nothing left in its temp dir
        assert server.stop(how=signal.SIGTERM) == 0, server.log_text()[-3000:]
    assert our_segments_left(watch) == []
    assert left_in_temp(env) == []
    return image, server, metrics


def test_seed_document_over_mooncake_gives_the_shared_memory_image(
    tiny_bagel: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if missing := mooncake_missing():
        pytest.skip(missing)
    with ThreadPoolExecutor(2) as pool:  # the two servers side by side
        shm = pool.submit(
            serve_seed_request, tiny_bagel, SEED_DOCUMENT.read_text(), tmp_path_factory.mktemp("shm")
        )
        mooncake = pool.submit(
            serve_seed_request, tiny_bagel, mooncake_document(), tmp_path_factory.mktemp("mooncake")
        )
        over_shm, _, _ = shm.result()
        over_mooncake, server, metrics = mooncake.result()
    assert over_mooncake.shape == (48, 64, 3)  # an edit keeps its input's size
    np.testing.assert_array_equal(over_mooncake, over_shm)
    # the context crossed through Mooncake (READ by the DiT's engine), not through shared memory
    log = server.log_text()
    assert "Traceback" not in log
    assert metric_value(metrics, "omni_context_exports_total") >= 1
    # the DiT's engine acknowledged its READ over the side channel: the bytes went through Mooncake
    assert metric_value(metrics, "omni_context_export_bytes_total", direction="acked") > 0
