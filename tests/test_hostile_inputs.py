"""Inputs that once hurt other requests, against a real ``vllm serve --omni`` of the tiny Qwen-Image-Edit:
a 200,000-character prompt sent among normal edits (it was padded into their batch and the stage was
killed for memory), prompts past the model's token limit, more source images than the model takes, a
30 MB prompt beside /health, and a full batch of the longest prompts the model allows against the stage's
memory budget. The barrage of many more bodies is ``test_hostile_barrage.py``."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
from PIL import Image

from helpers import serve_model
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.server import ServerProcess

pytestmark = pytest.mark.server

TOKEN_LIMIT = 1024  # the Qwen-Image pipelines' (QwenImageRunner.prompt_token_limit)
BUDGET_BYTES = 3 << 30
"""The diffusion stage's memory budget here: gpu_memory_utilization is this share of the machine."""
MAX_BATCH = 6
DEPLOY = """
pipeline: diffusion
stages:
  - stage_id: 0
    max_batch_size: {max_batch}
    num_inference_steps: 2
    gpu_memory_utilization: {fraction}
"""
EDITS = "/v1/images/edits"


def png(seed: int, side: int = 48) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def server(tiny_qwen_image_edit: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("hostile")
    deploy = directory / "deploy.yaml"
    fraction = BUDGET_BYTES / psutil.virtual_memory().total
    deploy.write_text(DEPLOY.format(max_batch=MAX_BATCH, fraction=f"{fraction:.6f}"))
    yield from serve_model(tiny_qwen_image_edit, deploy, directory)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen_image_edit: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_qwen_image_edit), subfolder="tokenizer")


def prompt_of(tokenizer: Any, tokens: int) -> str:
    """A prompt of exactly ``tokens`` tokens (as the model's tokenizer counts them)."""
    ids = tokenizer(" ".join(["painted"] * tokens), add_special_tokens=False)["input_ids"][:tokens]
    text = tokenizer.decode(ids)
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == tokens
    return text


def replica(server: ServerProcess) -> dict[str, Any]:
    """The diffusion stage's replica as /health reports it."""
    return http_client.get(server.base_url + "/health", timeout=30).json()["stages"]["0"]["replicas"][0]


def stage_counts(server: ServerProcess) -> tuple[float, int]:
    """(replica deaths, restarts) of the diffusion stage."""
    deaths = server.metric("omni_stage_replica_deaths_total", stage="0", name="diffusion")
    return deaths, replica(server)["restarts"]


async def edit(client: httpx.AsyncClient, prompt: str, seed: int, **fields: Any) -> httpx.Response:
    data = {"prompt": prompt, "seed": str(seed), **{k: str(v) for k, v in fields.items()}}
    return await client.post(EDITS, data=data, files={"image": ("source.png", png(seed))})


def test_a_200k_character_prompt_among_five_normal_edits_is_refused_alone(server: ServerProcess) -> None:
    before = stage_counts(server)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            long = edit(client, "make it look like a watercolour " * 6250, 100)  # 200,000 characters
            normal = [edit(client, f"make it blue, version {i}", i) for i in range(5)]
            return list(await asyncio.gather(long, *normal))

    long, *normal = asyncio.run(main())
    assert long.status_code == 400, long.text
    assert long.json()["error"]["message"] == (
        "prompt is 200000 characters; this server accepts at most 32000 (--image-max-prompt-chars)"
    )
    for response in normal:
        assert response.status_code == 200, response.text
        image = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
        assert image.size[0] > 0
    assert stage_counts(server) == before  # no death, no restart


def test_prompts_past_the_models_token_limit_are_refused_naming_it(
    server: ServerProcess, tokenizer: Any
) -> None:
    over = prompt_of(tokenizer, TOKEN_LIMIT + 1)
    assert len(over) < 32_000  # under the character limit: the model's own limit refuses it

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            return [
                await edit(client, over, 1),
                await edit(client, "make it red", 2, negative_prompt=over, guidance_scale=2.0),
                await edit(client, prompt_of(tokenizer, TOKEN_LIMIT), 3),
            ]

    prompt, negative, at_limit = asyncio.run(main())
    model = f"this model (QwenImageEditPipeline) encodes at most {TOKEN_LIMIT} prompt tokens"
    assert prompt.status_code == 400 and model in prompt.json()["error"]["message"]
    assert f"prompt is {TOKEN_LIMIT + 1} tokens" in prompt.json()["error"]["message"]
    assert negative.status_code == 400
    assert f"negative_prompt is {TOKEN_LIMIT + 1} tokens" in negative.json()["error"]["message"]
    assert at_limit.status_code == 200, at_limit.text


def test_more_source_images_than_the_model_takes_are_refused_before_any_stage(server: ServerProcess) -> None:
    files = [("image[]", (f"{i}.png", png(i))) for i in range(2)]
    response = http_client.post(
        server.base_url + EDITS, data={"prompt": "merge them"}, files=files, timeout=60
    )
    assert response.status_code == 400, response.text
    assert "at most 1 images per request" in response.json()["error"]["message"]


def test_a_30_mb_prompt_does_not_hold_health(server: ServerProcess) -> None:
    """Refused before anything tokenizes it, by the body's size (this model takes one source image, so
    the JSON body limit is one image's base64 and a megabyte) or, just under that, by the prompt's length;
    /health answers throughout (the slowest answer is printed: the event loop still reads and parses the
    body)."""
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            while not done.is_set():
                start = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.02)

    def chat(prompt: str) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": prompt}], "modalities": ["image"]}
        return http_client.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        thirty, twenty_eight = chat("a red fox " * 3_000_000), chat("a red fox " * 2_800_000)
    finally:
        done.set()
        prober.join()
    assert thirty.status_code == 413, thirty.text[:300]
    assert "the request body is 30000066 bytes; this server accepts at most" in thirty.text
    assert twenty_eight.status_code == 400, twenty_eight.text[:300]
    assert (
        "messages is 27999999 characters; this server accepts at most 32000"
    )  # stripped in twenty_eight.text
    assert latencies
    print(
        f"/health during 30 and 28 MB prompts: {len(latencies)} answers, slowest {max(latencies) * 1e3:.0f} ms"
    )


def test_a_full_batch_of_the_longest_prompts_stays_within_the_stage_budget(
    server: ServerProcess, tokenizer: Any
) -> None:
    """Every prompt of a full batch padded to the model's limit: the stage's peak memory (its process's
    high-water RSS, weights and runtime included) stays within its budget."""
    longest = prompt_of(tokenizer, TOKEN_LIMIT)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
            with server.hold("dit.step") as hold:
                blocker = asyncio.ensure_future(edit(client, "hold the stage", 50))
                await asyncio.to_thread(hold.wait, alive=server.alive)
                batch = [asyncio.ensure_future(edit(client, longest, 60 + i)) for i in range(MAX_BATCH)]
                while server.metric("omni_stage_queue_depth", stage="0", name="diffusion") < MAX_BATCH + 1:
                    await asyncio.sleep(0.05)
            return [await blocker, *(await asyncio.gather(*batch))]

    for response in asyncio.run(main()):
        assert response.status_code == 200, response.text
    pid = replica(server)["pid"]
    peak = (
        int(
            next(
                line
                for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmHWM")
            ).split()[1]
        )
        << 10
    )
    print(f"diffusion stage peak RSS {peak / 2**20:.0f} MiB of a {BUDGET_BYTES / 2**20:.0f} MiB budget")
    assert peak <= BUDGET_BYTES
