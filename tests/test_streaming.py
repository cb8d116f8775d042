"""Streamed answers of the diffusion-only pipelines through real servers and the official ``openai``
client: a generation of the tiny SD3 with ``partial_images=2`` yields two previews and a completed image
equal to the same request not streamed; the same for an edit of the tiny Qwen-Image-Edit; a client that
closes the stream after its first preview has its request aborted in every stage (the DiT is held by a
hold point meanwhile, so the test does not depend on the machine's speed). The tiny GLM-Image's streams
(its AR stage's progress first; chat's image as a content part) are tested on the one GLM-Image server
of ``test_api_server.py``."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from helpers import assert_streamed, pixels, serve_model
from vllm_omni_testkit.harness.server import (
    ServerProcess,
    wait_for_metric,
)

pytestmark = pytest.mark.server

DIFFUSION_DEPLOY = """
pipeline: diffusion
stages:
  - stage_id: 0
    max_batch_size: 4
    num_inference_steps: 6
"""


@pytest.fixture(scope="module")
def sd3(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("sd3")
    (directory / "deploy.yaml").write_text(DIFFUSION_DEPLOY)
    yield from serve_model(tiny_sd3, directory / "deploy.yaml", directory)


@pytest.fixture(scope="module")
def qwen_edit(
    tiny_qwen_image_edit: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("qwen_edit")
    (directory / "deploy.yaml").write_text(DIFFUSION_DEPLOY)
    yield from serve_model(tiny_qwen_image_edit, directory / "deploy.yaml", directory)


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=600, max_retries=0)


def png(seed: int) -> bytes:
    out = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_a_streamed_generation_gives_its_previews_then_the_image_it_gives_unstreamed(
    sd3: ServerProcess,
) -> None:
    client = client_of(sd3)
    ask = {"model": sd3.argv[2], "prompt": "a lighthouse at dusk", "size": "64x64"}
    extra = {"seed": 5, "num_inference_steps": 8}
    plain = pixels(client.images.generate(**ask, extra_body=extra).data[0].b64_json)
    events = list(client.images.generate(**ask, stream=True, partial_images=2, extra_body=extra))
    assert assert_streamed(events, "image_generation", 2, plain) == []  # no AR stage: nothing first


def test_a_streamed_edit_gives_its_previews_then_the_image_it_gives_unstreamed(
    qwen_edit: ServerProcess,
) -> None:
    client = client_of(qwen_edit)
    ask = {"model": qwen_edit.argv[2], "prompt": "make it blue", "image": ("s.png", png(1))}
    extra = {"seed": 9, "num_inference_steps": 6}
    plain = pixels(client.images.edit(**ask, extra_body=extra).data[0].b64_json)
    events = list(client.images.edit(**ask, stream=True, partial_images=2, extra_body=extra))
    assert assert_streamed(events, "image_edit", 2, plain) == []


def test_a_client_that_closes_the_stream_after_its_first_preview_aborts_the_request(
    sd3: ServerProcess,
) -> None:
    """The preview thread holds once it has handed over the first preview, so the call waits before its
    own decode; the client, once it has that preview, closes the stream; the server notices and aborts;
    released, the DiT drops the request at its step end: no image is made."""
    client = client_of(sd3)
    labels = {"stage": "0", "name": "diffusion"}
    drops = sd3.metric("omni_stage_aborted_requests_total", **labels, where="batch")
    gone = sd3.metric("omni_client_disconnects_total", endpoint="images/generations")
    made = sd3.metric("omni_images_generated_total", endpoint="images/generations")
    ask = {"model": sd3.argv[2], "prompt": "a painting nobody waits for", "size": "64x64"}
    with sd3.hold("dit.preview") as hold:
        stream = client.images.generate(
            **ask, stream=True, partial_images=3, extra_body={"num_inference_steps": 40}
        )
        first = next(iter(stream))
        assert first.type == "image_generation.partial_image" and first.partial_image_index == 0
        hold.wait(alive=sd3.alive)
        stream.close()
        wait_for_metric(
            lambda sample: sd3.metric(sample, endpoint="images/generations"),
            "omni_client_disconnects_total",
            gone + 1,
        )
    wait_for_metric(
        lambda sample: sd3.metric(sample, **labels, where="batch"),
        "omni_stage_aborted_requests_total",
        drops + 1,
    )
    assert sd3.metric("omni_images_generated_total", endpoint="images/generations") == made
    stages = httpx.get(sd3.base_url + "/health", timeout=10).json()["stages"]
    assert all(r["inflight"] == 0 for s in stages.values() for r in s["replicas"])


def test_streaming_takes_one_image_per_request(sd3: ServerProcess) -> None:
    response = httpx.post(sd3.base_url + "/v1/images/generations",
                          json={"prompt": "two", "n": 2, "stream": True}, timeout=60)  # fmt: skip
    assert response.status_code == 400 and "send n=1" in response.json()["error"]["message"]
    response = httpx.post(sd3.base_url + "/v1/images/generations",
                          json={"prompt": "many", "stream": True, "partial_images": 4}, timeout=60)  # fmt: skip
    assert response.status_code == 400 and "partial_images" in response.json()["error"]["message"]
