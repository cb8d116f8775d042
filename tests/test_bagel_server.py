"""BAGEL served end to end: ``vllm serve <tiny BAGEL> --omni --deploy-config deploy/tiny_bagel_cpu.yaml``
through the stock ``vllm`` script, driven with the official ``openai`` client and raw HTTP.

Covers the request of vllm-omni's stage proc/client refactor (chat, text + ``image_url``,
``modalities: ["image"]``, size, steps and seed at the top level), the chat content parts its clients
read, the image endpoints, understanding in text, the pipeline's settings, and what a long run must not
leave behind: KV blocks in the thinker, exported contexts nobody released, shared memory after shutdown.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from helpers import our_segments_left
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.leaks import LeakWatch
from vllm_omni_testkit.harness.served_reference import BAGEL
from vllm_omni_testkit.harness.server import (
    ServerProcess,
    bin_script,
    cpu_test_env,
    free_port,
    metric_value,
)

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parent.parent
DEPLOY = str(REPO / "deploy" / "tiny_bagel_cpu.yaml")
MODEL = "tiny-bagel"


@pytest.fixture(scope="module")
def server(tiny_bagel: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    proc = ServerProcess(
        [
            bin_script("vllm"), "serve", str(tiny_bagel), "--omni", "--deploy-config", DEPLOY,
            "--port", str(port), "--host", "127.0.0.1", "--served-model-name", MODEL,
        ],
        port=port,
        log_path=tmp_path_factory.mktemp("bagel_server") / "server.log",
        env=cpu_test_env({"VLLM_LOG_STATS_INTERVAL": "1"}),  # /metrics sees the thinker's export counters
    )  # fmt: skip
    with proc:
        assert proc.proc is not None
        watch = LeakWatch(root=proc.proc.pid).start()
        proc.wait_ready(timeout=300)
        BAGEL.of(proc, tmp_path_factory)  # the run's BAGEL reference (test_v2_runner_on_cpu.py's V1 side)
        yield proc
    assert our_segments_left(watch) == []


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300, max_retries=0)


def png(width: int = 64, height: int = 48, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def data_uri(blob: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(blob).decode()


def image_of(content: Any) -> Image.Image:
    """What vllm-omni's clients do: ``message.content[0]["image_url"]["url"]``, a PNG data URI."""
    url = content[0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,"), str(content)[:200]
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    image.load()
    return image


def test_the_seed_request(server: ServerProcess) -> None:
    """The edit request vllm-omni's stage refactor was tested with, sent as its curl sends it."""
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "<|im_start|>Turn the main subject into a polished gold sculpture.<|im_end|>",
                    },
                    {"type": "image_url", "image_url": {"url": data_uri(png())}},
                ],
            }
        ],
        "modalities": ["image"],
        "height": 512,
        "width": 512,
        "num_inference_steps": 6,
        "seed": 42,
    }
    response = http_client.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert image_of(message["content"]).size == (64, 48)  # an edit keeps its input's (resized) size


def test_served_images_equal_the_reference(client: openai.OpenAI, tiny_bagel: Path) -> None:
    """Text to image and an edit through HTTP (PNG is lossless) against BAGEL's interleave_inference."""
    assert_reference_images(client, MODEL, tiny_bagel)


def assert_reference_images(client: openai.OpenAI, model: str, tiny_bagel: Path) -> None:
    """A text-to-image chat request and an edit, each within :func:`assert_close` of BAGEL's own."""
    from vllm_omni_testkit.reference.bagel import BagelReference

    reference = BagelReference(str(tiny_bagel))
    steps = {"num_inference_steps": 6}
    t2i = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "a red fox in the snow"}],
        extra_body={"modalities": ["image"], "height": 64, "width": 64, "seed": 11, **steps},
    )
    expected = reference.interleave(
        ["a red fox in the snow"],
        height=64,
        width=64,
        seed=11,
        cfg_text_scale=4.0,
        cfg_img_scale=1.0,
        **steps,
    )
    assert_close(np.asarray(image_of(t2i.choices[0].message.content)), expected.image)
    source = Image.open(io.BytesIO(png(seed=9)))
    edit = client.images.edit(
        model=model,
        image=("in.png", png(seed=9), "image/png"),
        prompt="make it blue",
        extra_body={"seed": 12, **steps},
    )
    expected = reference.interleave(
        [source, "make it blue"], seed=12, cfg_text_scale=4.0, cfg_img_scale=2.0, cfg_interval=(0.0, 1.0),
        cfg_renorm_type="text_channel", **steps,
    )  # fmt: skip
    assert_close(np.asarray(Image.open(io.BytesIO(base64.b64decode(edit.data[0].b64_json)))), expected.image)


def assert_close(ours: np.ndarray, reference: np.ndarray) -> None:
    assert ours.shape == reference.shape
    diff = np.abs(ours.astype(int) - reference.astype(int))
    assert diff.max() <= 2 and diff.mean() <= 0.1, (diff.max(), diff.mean())  # 2/255, 0.1/255


def test_ten_edit_jobs_in_a_row_with_the_openai_client(client: openai.OpenAI) -> None:
    sizes = set()
    for job in range(10):
        response = client.chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": f"edit number {job}: make it brighter"},
                        {"type": "image_url", "image_url": {"url": data_uri(png(seed=job))}},
                    ],
                }
            ],
            extra_body={"modalities": ["image"], "num_inference_steps": 4, "seed": job},
        )
        sizes.add(image_of(response.choices[0].message.content).size)
    assert sizes == {(64, 48)}


def test_image_endpoints(client: openai.OpenAI) -> None:
    generated = client.images.generate(
        model=MODEL, prompt="a red fox", size="64x64", extra_body={"seed": 1, "num_inference_steps": 4}
    )
    image = Image.open(io.BytesIO(base64.b64decode(generated.data[0].b64_json)))
    assert image.size == (64, 64)
    edited = client.images.edit(
        model=MODEL,
        image=("in.png", png(96, 64), "image/png"),
        prompt="make it blue",
        extra_body={"seed": 1, "num_inference_steps": 4, "cfg_renorm_type": "global"},
    )
    assert Image.open(io.BytesIO(base64.b64decode(edited.data[0].b64_json))).size == (96, 64)
    assert edited.size == "96x64"

    # A variation: the thinker's own description of the image (greedy, as in chat) drives a generation of
    # the image's size; the description comes back as each image's revised_prompt.
    from vllm_omni_plugin.entrypoints.api_calls import DESCRIBE_PROMPT, DESCRIPTION_TOKENS

    source = png(96, 64, seed=4)
    steps = {"seed": 7, "num_inference_steps": 4}
    varied = client.images.create_variation(
        model=MODEL, image=("in.png", source, "image/png"), n=2, extra_body=steps
    )
    description = varied.data[0].revised_prompt
    assert description and all(item.revised_prompt == description for item in varied.data)
    described = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(source)}},
            {"type": "text", "text": DESCRIBE_PROMPT},
        ]}],
        max_tokens=DESCRIPTION_TOKENS,
        temperature=0.0,
    )  # fmt: skip
    assert described.choices[0].message.content.strip() == description
    drawn = client.images.generate(model=MODEL, prompt=description, size="96x64", n=2, extra_body=steps)
    for variation, generated in zip(varied.data, drawn.data, strict=True):
        assert base64.b64decode(variation.b64_json) == base64.b64decode(generated.b64_json)


def test_settings_change_the_image_and_are_checked(client: openai.OpenAI, server: ServerProcess) -> None:
    def chat(**settings: Any) -> np.ndarray:
        response = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a red fox"}],
            extra_body={
                "modalities": ["image"],
                "height": 64,
                "width": 64,
                "seed": 3,
                "num_inference_steps": 4,
                **settings,
            },
        )
        return np.asarray(image_of(response.choices[0].message.content), dtype=int)

    assert np.abs(chat(cfg_text_scale=1.0) - chat(cfg_text_scale=4.0)).mean() > 1.0
    bad = http_client.post(
        server.base_url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "modalities": ["image"],
            "cfg_renorm_type": "loud",
        },
        timeout=30,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cfg_renorm_type"
    too_big = http_client.post(
        server.base_url + "/v1/images/generations",
        json={"prompt": "x", "size": "512x512", "num_inference_steps": 2},
        timeout=60,
    )
    assert too_big.status_code == 400 and "128" in too_big.json()["error"]["message"], too_big.text


def test_understanding_answers_in_text(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_uri(png())}},
                    {"type": "text", "text": "what is in the picture?"},
                ],
            }
        ],
        max_tokens=12,
        temperature=0.0,
    )
    choice = response.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert response.usage.completion_tokens <= 12 and response.usage.prompt_tokens > 20


def test_think_mode_returns_the_plan_with_the_image(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a red fox"}],
        extra_body={"modalities": ["image"], "height": 64, "width": 64, "num_inference_steps": 4,
                    "think": True, "max_think_tokens": 8},
    )  # fmt: skip
    content = response.choices[0].message.content
    assert image_of(content).size == (64, 64)
    assert content[1]["type"] == "text"


def test_nothing_held_after_fifty_mixed_requests(server: ServerProcess) -> None:
    """Text-to-image, edits, understanding, think mode and requests whose client goes away: afterwards
    the thinker holds no KV blocks and every exported context was released."""

    async def one(http: httpx.AsyncClient, i: int) -> int:
        kind = i % 5
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"request {i}"}]
        body: dict[str, Any] = {
            "modalities": ["image"],
            "height": 64,
            "width": 64,
            "num_inference_steps": 4,
            "seed": i,
        }
        if kind == 1:
            messages = [{"role": "user", "content": [{"type": "text", "text": "edit"},
                                                     {"type": "image_url", "image_url": {"url": data_uri(png(seed=i))}}]}]  # fmt: skip
        elif kind == 2:
            body = {"max_tokens": 8}
        elif kind == 3:
            body.update(think=True, max_think_tokens=6)
        try:
            response = await http.post(
                "/v1/chat/completions",
                json={"messages": messages, **body},
                timeout=0.3 if kind == 4 else 120,  # kind 4: the client gives up mid-request
            )
        except httpx.TimeoutException:
            return 0
        return response.status_code

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            sem = asyncio.Semaphore(8)

            async def limited(i: int) -> int:
                async with sem:
                    return await one(http, i)

            return await asyncio.gather(*(limited(i) for i in range(50)))

    statuses = asyncio.run(run())
    assert all(code in (0, 200) for code in statuses), statuses
    assert statuses.count(200) >= 40
    deadline = time.monotonic() + 300
    while True:
        thinker = http_client.get(server.base_url + "/health", timeout=10).json()["stages"]["0"]["replicas"][
            0
        ]
        metrics = http_client.get(server.base_url + "/metrics", timeout=10).text
        exports = metric_value(metrics, "omni_context_exports_total")
        held = metric_value(metrics, "omni_context_export_outstanding")
        idle = (
            thinker.get("running") == 0
            and thinker.get("waiting") == 0
            and thinker.get("kv_cache_usage") == 0.0
        )
        if idle and exports > 0 and held == 0:
            break
        assert time.monotonic() < deadline, (thinker, exports, held)
        time.sleep(0.5)


def test_a_dit_death_runs_the_request_again_from_the_thinker(server: ServerProcess) -> None:
    """The DiT process is killed while it denoises an edit. The contexts it had read are gone with it, so
    the request runs the thinker again (fresh contexts, the companions too) and then the restarted DiT:
    the client gets the image an undisturbed run gives, and nothing stays held."""
    health = http_client.get(server.base_url + "/health", timeout=10).json()
    dit_pid = health["stages"]["1"]["replicas"][0]["pid"]
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a long edit"},
                    {"type": "image_url", "image_url": {"url": data_uri(png(seed=7))}},
                ],
            }
        ],  # fmt: skip
        "modalities": ["image"],
        "height": 64,
        "width": 64,
        "num_inference_steps": 20,
        "seed": 1,
    }
    before = http_client.get(server.base_url + "/metrics", timeout=10).text

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
            with server.hold("dit.step") as hold:  # one-shot: the restarted DiT does not hold the retry
                task = asyncio.create_task(http.post("/v1/chat/completions", json=body))
                await asyncio.to_thread(hold.wait, alive=server.alive)
                os.kill(dit_pid, signal.SIGKILL)  # while the DiT works on the request
            return await task

    response = asyncio.run(run())
    assert response.status_code == 200, response.text
    retried = np.asarray(image_of(response.json()["choices"][0]["message"]["content"]))
    stages = http_client.get(server.base_url + "/health", timeout=10).json()["stages"]
    assert stages["1"]["replicas"][0]["pid"] != dit_pid
    undisturbed = http_client.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert undisturbed.status_code == 200, undisturbed.text
    expected = np.asarray(image_of(undisturbed.json()["choices"][0]["message"]["content"]))
    assert np.abs(retried.astype(int) - expected.astype(int)).max() <= 1
    after = http_client.get(server.base_url + "/metrics", timeout=10).text
    retries = [metric_value(text, "omni_stage_retries_total", stage="1") for text in (before, after)]
    assert retries[1] - retries[0] == 1
    assert metric_value(after, "omni_stage_replica_deaths_total", stage="1") >= 1
    deadline = time.monotonic() + 300
    while True:  # the thinker freed both runs' blocks; every context of both runs was released
        thinker = http_client.get(server.base_url + "/health", timeout=10).json()["stages"]["0"]["replicas"][
            0
        ]
        held = metric_value(
            http_client.get(server.base_url + "/metrics", timeout=10).text, "omni_context_export_outstanding"
        )
        if thinker.get("kv_cache_usage") == 0.0 and held == 0:
            break
        assert time.monotonic() < deadline, (thinker, held)
        time.sleep(0.5)
