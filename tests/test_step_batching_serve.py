"""``batching: step`` served end to end: a deploy file turns it on, concurrent requests of different step
counts over HTTP each get the image a direct diffusers call makes (at most 1/255 apart), and ``/metrics``
counts the stage's steps, queue waits and decodes."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from vllm_omni_testkit.harness.server import ServerProcess, bin_script, free_port
from vllm_omni_testkit.reference.diffusers import reference_image

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore::FutureWarning")]

DEPLOY = """\
pipeline: diffusion
stages:
  - stage_id: 0
    max_batch_size: 4
    batching: step
    batch_wait_ms: 5
"""
GUIDANCE = 3.0


@pytest.fixture(scope="module")
def server(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("step_serve")
    deploy = tmp / "deploy.yaml"
    deploy.write_text(DEPLOY)
    port = free_port()
    argv = [bin_script("vllm"), "serve", str(tiny_sd3), "--omni", "--deploy-config", str(deploy),
            "--port", str(port), "--host", "127.0.0.1", "--served-model-name", "tiny-sd3"]  # fmt: skip
    with ServerProcess(argv, port=port, log_path=tmp / "server.log") as served:
        served.wait_ready(timeout=300)
        yield served


async def generate(base_url: str, requests: list[tuple[int, int]]) -> list[np.ndarray]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:

        async def one(seed: int, steps: int) -> np.ndarray:
            response = await client.post(
                "/v1/images/generations",
                json={
                    "model": "tiny-sd3",
                    "prompt": f"a red fox number {seed}",
                    "size": "64x64",
                    "seed": seed,
                    "num_inference_steps": steps,
                    "guidance_scale": GUIDANCE,
                },
            )
            assert response.status_code == 200, response.text
            return np.asarray(
                Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
            )

        return list(await asyncio.gather(*(one(seed, steps) for seed, steps in requests)))


def test_concurrent_requests_get_their_own_images_and_metrics_count_the_steps(
    server: ServerProcess, tiny_sd3: Path
) -> None:
    requests = [(seed, 2 + seed % 3) for seed in range(6)]  # 2, 3 and 4 steps: some leave early
    images = asyncio.run(generate(server.base_url, requests))
    for (seed, steps), image in zip(requests, images, strict=True):
        direct = reference_image(
            tiny_sd3, prompt=f"a red fox number {seed}", seed=seed, height=64, width=64, steps=steps,
            guidance=GUIDANCE,
        )  # fmt: skip
        diff = np.abs(image.astype(np.int16) - direct.astype(np.int16))
        assert diff.max() <= 1, (seed, diff.max())
    assert server.metric("omni_diffusion_denoise_steps_total") == sum(steps for _, steps in requests)
    assert server.metric("omni_diffusion_started_requests_total") == len(requests)
    steps = server.metric("omni_diffusion_steps_total")
    assert steps > 0 and server.metric("omni_diffusion_step_requests_total") >= steps
    assert server.metric("omni_diffusion_step_seconds_total") > 0
    assert 1 <= server.metric("omni_diffusion_decodes_total") <= len(requests)
    assert server.metric("omni_diffusion_decode_seconds_total") > 0
    encode, call = (server.metric(f"omni_diffusion_{name}_seconds_total") for name in ("encode", "call"))
    assert 0 < encode and 0 < call and server.metric("omni_diffusion_decode_seconds_total") + encode < call
