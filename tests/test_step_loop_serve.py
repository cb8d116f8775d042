"""``batching: loop`` served (issue 40, on this branch): the tiny SD3 behind ``vllm serve --omni``; a
short request sent while a long one runs comes back long before it, with the image it gets alone, and
concurrent requests each get diffusers' image."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import serve_model
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.images import pixels
from vllm_omni_testkit.harness.server import ServerProcess

pytestmark = pytest.mark.server

DEPLOY = """
pipeline: diffusion
stages:
  - stage_id: 0
    max_batch_size: 8
    batching: loop
"""


@pytest.fixture(scope="module")
def server(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("loop")
    (directory / "deploy.yaml").write_text(DEPLOY)
    yield from serve_model(tiny_sd3, directory / "deploy.yaml", directory)


def generate(server: ServerProcess, prompt: str, seed: int, steps: int) -> tuple[np.ndarray, float]:
    body = {"prompt": prompt, "size": "64x64", "seed": seed, "num_inference_steps": steps}
    start = time.perf_counter()
    answer = http_client.post(server.base_url + "/v1/images/generations", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    return pixels(answer.json()["data"][0]["b64_json"]), time.perf_counter() - start


def alone(tiny_sd3: Path, prompt: str, seed: int, steps: int) -> np.ndarray:
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        image = pipe(
            prompt=prompt, height=64, width=64, num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
        ).images[0]  # fmt: skip
    return (image * 255).round().astype(np.uint8)


def test_a_short_request_beside_a_long_one_finishes_first_with_its_own_image(
    server: ServerProcess, tiny_sd3: Path
) -> None:
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(generate, server, "a long one", 1, 300)
        time.sleep(1.0)  # the long one is running (this test only reports the times it saw)
        short_image, short_s = generate(server, "a short one", 2, 4)
        done_when_short_was = long.done()
        long_image, long_s = long.result()
    print(f"short {short_s:.2f} s, long {long_s:.2f} s")
    assert not done_when_short_was
    assert np.abs(short_image.astype(int) - alone(tiny_sd3, "a short one", 2, 4).astype(int)).max() <= 1
    assert long_image.std() > 5


def test_concurrent_requests_each_get_diffusers_image(server: ServerProcess, tiny_sd3: Path) -> None:
    jobs: list[Any] = [(f"thing {i}", 10 + i, 3 + i % 3) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        images = list(pool.map(lambda job: generate(server, *job)[0], jobs))
    for (prompt, seed, steps), image in zip(jobs, images, strict=True):
        assert np.abs(image.astype(int) - alone(tiny_sd3, prompt, seed, steps).astype(int)).max() <= 1, prompt
