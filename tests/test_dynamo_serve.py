"""The pipeline role under Dynamo: Dynamo's real HTTP frontend (``make_engine`` + ``run_input``, what
``python -m dynamo.frontend`` runs) and ``python -m vllm_omni_plugin.dynamo`` serving the whole tiny
GLM-Image, then the tiny BAGEL, discovered through a folder, on loopback. The official ``openai`` client
gets what ``vllm serve --omni`` gives for the same request (the same pixels); a bad request is one 400
with our message and one line in the worker's log; a client that goes away has its request aborted in
every stage."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from vllm_omni_testkit.harness.dynamo import DynamoSite, dynamo_missing
from vllm_omni_testkit.harness.server import (
    ServerProcess,
    bin_script,
    cpu_test_env,
    free_port,
    wait_for_metric,
)

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(dynamo_missing() is not None, reason=str(dynamo_missing())),
]

REPO = Path(__file__).resolve().parent.parent
GLM_DEPLOY = REPO / "deploy" / "tiny_glm_image_cpu.yaml"
BAGEL_DEPLOY = REPO / "deploy" / "tiny_bagel_cpu.yaml"
GLM = "tiny-glm-image"
BAGEL = "tiny-bagel"
PROMPT = "a red fox in the snow"
ENDLESS = 100_000
"""Steps no request finishes while a test holds it (nvext's step count is a u8: these go top-level)."""


def png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def uri_pixels(uri: str) -> np.ndarray:
    assert uri.startswith("data:image/png;base64,"), uri[:40]
    return pixels(uri.split(",", 1)[1])


SOURCES = [np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8) for seed in (1, 2)]


def vllm_serve_images(model: Path, deploy: Path, log_dir: Path) -> dict[str, np.ndarray]:
    """What ``vllm serve --omni`` makes for this module's requests: a generation and a two-image edit."""
    port = free_port()
    argv = [bin_script("vllm"), "serve", str(model), "--omni", "--deploy-config", str(deploy),
            "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
    with ServerProcess(argv, port=port, log_path=log_dir / "vllm_serve.log", env=cpu_test_env()) as server:
        server.wait_ready(timeout=600)
        made = httpx.post(
            server.base_url + "/v1/images/generations",
            json={"prompt": PROMPT, "size": "64x64", "seed": 11, "num_inference_steps": 4},
            timeout=300,
        )
        assert made.status_code == 200, made.text
        files = [("image", (f"{i}.png", png(image), "image/png")) for i, image in enumerate(SOURCES)]
        edited = httpx.post(
            server.base_url + "/v1/images/edits",
            data={"prompt": "make it blue", "seed": "5", "num_inference_steps": "4"},
            files=files,
            timeout=300,
        )
        assert edited.status_code == 200, edited.text
        return {
            "generation": pixels(made.json()["data"][0]["b64_json"]),
            "edit": pixels(edited.json()["data"][0]["b64_json"]),
        }


def wait_model(frontend: ServerProcess, name: str, worker: ServerProcess, timeout: float = 900) -> None:
    """Until the frontend lists ``name`` (its worker registered it once its stages were up)."""

    def listed() -> bool:
        if not worker.alive():
            raise AssertionError(f"the worker exited before registering {name}:\n{worker.log_text()[-4000:]}")
        models = httpx.get(frontend.base_url + "/v1/models", timeout=5).json()["data"]
        return any(m["id"] == name for m in models)

    frontend.wait_until(listed, timeout, stop=False)  # the module's frontend: later tests use it


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoSite]:
    """Dynamo's frontend; at the end, nothing of this module's left (processes, shared memory)."""
    with DynamoSite.running(tmp_path_factory.mktemp("dynamo_serve")) as site:
        yield site


@dataclass
class Served:
    site: DynamoSite
    worker: ServerProcess
    client: openai.OpenAI
    model: str
    reference: dict[str, np.ndarray]

    @property
    def frontend(self) -> ServerProcess:
        return self.site.processes[0]

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.frontend.base_url + path, json={"model": self.model, **body}, timeout=300)


def serve(site: DynamoSite, model: Path, deploy: Path, name: str, *flags: str) -> ServerProcess:
    worker = site.worker(
        model, "--deploy-config", str(deploy), "--served-model-name", name,
        "--image-max-inference-steps", str(ENDLESS), *flags, name=name,
    )  # fmt: skip
    wait_model(site.processes[0], name, worker)
    return worker


@pytest.fixture(scope="class")
def glm(site: DynamoSite, tiny_glm_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    reference: dict[str, Any] = {}
    baseline = threading.Thread(  # vllm serve --omni starts beside the worker
        target=lambda: reference.update(vllm_serve_images(tiny_glm_image, GLM_DEPLOY, site.directory))
    )
    baseline.start()
    worker = serve(site, tiny_glm_image, GLM_DEPLOY, GLM)
    baseline.join(900)
    assert reference, "vllm serve --omni gave no image"
    client = openai.OpenAI(base_url=site.processes[0].base_url + "/v1", api_key="unused", timeout=300)
    try:
        yield Served(site, worker, client, GLM, reference)
    finally:
        client.close()
        statuses = site.stop([worker], how=signal.SIGTERM)
        assert statuses and set(statuses.values()) == {0}, statuses  # as systemd or Kubernetes stop it


class TestGlmImage:
    def test_the_openai_client_gets_the_image_vllm_serve_makes(self, glm: Served) -> None:
        for extra in (
            {"nvext": {"seed": 11, "num_inference_steps": 4}},
            {"seed": 11, "num_inference_steps": 4},
        ):
            made = glm.client.images.generate(model=GLM, prompt=PROMPT, size="64x64", extra_body=extra)
            image = pixels(made.data[0].b64_json)
            assert image.shape == (64, 64, 3)
            np.testing.assert_array_equal(image, glm.reference["generation"])
        assert made.size == "64x64" and made.created > 0

    def test_chat_answers_with_the_image_streamed_or_not(self, glm: Served) -> None:
        settings = {"chat_template_kwargs": {"size": "64x64", "num_inference_steps": 4}}
        messages = [{"role": "user", "content": PROMPT}]
        chat = glm.client.chat.completions.create(model=GLM, messages=messages, seed=11, extra_body=settings)
        (part,) = chat.choices[0].message.content
        np.testing.assert_array_equal(uri_pixels(part["image_url"]["url"]), glm.reference["generation"])
        chunks = list(
            glm.client.chat.completions.create(
                model=GLM, messages=messages, seed=11, extra_body=settings, stream=True
            )
        )
        parts = [p for c in chunks for choice in c.choices for p in (choice.delta.content or [])]
        assert len(parts) == 1 and chunks[-1].choices[-1].finish_reason == "stop"
        np.testing.assert_array_equal(uri_pixels(parts[0]["image_url"]["url"]), glm.reference["generation"])

    def test_an_edit_takes_input_reference_and_more_images(self, glm: Served) -> None:
        uris = ["data:image/png;base64," + base64.b64encode(png(s)).decode() for s in SOURCES]
        edited = glm.post(
            "/v1/images/edits",
            {"prompt": "make it blue", "input_reference": uris[0], "images": uris[1:],
             "nvext": {"seed": 5, "num_inference_steps": 4}},
        )  # fmt: skip
        assert edited.status_code == 200, edited.text
        np.testing.assert_array_equal(pixels(edited.json()["data"][0]["b64_json"]), glm.reference["edit"])

    def test_a_bad_request_is_one_400_with_our_message_and_one_log_line(self, glm: Served) -> None:
        with pytest.raises(openai.BadRequestError) as caught:
            glm.client.images.generate(model=GLM, prompt=PROMPT, size="65x64")
        message = "width and height must be multiples of 32 and at least 32 pixels, got 65x64"
        assert caught.value.status_code == 400 and message in caught.value.response.text
        refused = glm.post("/v1/images/generations", {"prompt": PROMPT, "response_format": "url"})
        assert refused.status_code == 400 and "not served under Dynamo" in refused.text
        streamed = glm.post("/v1/images/generations", {"prompt": PROMPT, "stream": True})
        assert streamed.status_code == 400 and "not streamed through it" in streamed.text
        log = glm.worker.log_text()
        lines = [line for line in log.splitlines() if message in line and "failed (400)" in line]
        assert len(lines) == 1 and re.search(r"request \S+ \(images/generations\) failed \(400\)", lines[0])
        assert "Traceback" not in log

    def test_a_client_that_goes_away_is_aborted_in_every_stage(self, glm: Served) -> None:
        worker = glm.worker
        body = {"model": GLM, "prompt": "a painting nobody waits for", "size": "64x64", "seed": 3,
                "num_inference_steps": ENDLESS}  # fmt: skip
        for point, stage, where in (("ar.step", "0", "engine"), ("dit.step", "1", "batch")):
            drops = worker.metric("omni_stage_aborted_requests_total", stage=stage, where=where)
            gone = worker.metric("omni_client_disconnects_total")

            async def main(point: str = point) -> None:
                async with httpx.AsyncClient(base_url=glm.frontend.base_url, timeout=600) as client:
                    with worker.hold(point) as hold:  # the request is inside the stage
                        work = asyncio.ensure_future(client.post("/v1/images/generations", json=body))
                        await asyncio.to_thread(hold.wait, alive=worker.alive)
                        work.cancel()  # the client closes its connection
                        with pytest.raises(asyncio.CancelledError):
                            await work

            asyncio.run(main())
            wait_for_metric(
                lambda sample, stage=stage, where=where: worker.metric(sample, stage=stage, where=where),
                "omni_stage_aborted_requests_total",
                drops + 1,
            )
            assert worker.metric("omni_client_disconnects_total") == gone + 1
        steps = worker.metric("omni_diffusion_denoise_steps_total")
        time.sleep(1.0)  # dropped from the DiT's batch, not run on
        assert worker.metric("omni_diffusion_denoise_steps_total") == steps
        made = glm.client.images.generate(
            model=GLM,
            prompt=PROMPT,
            size="64x64",
            extra_body={"nvext": {"seed": 11, "num_inference_steps": 4}},
        )
        np.testing.assert_array_equal(pixels(made.data[0].b64_json), glm.reference["generation"])


@pytest.fixture(scope="class")
def bagel(site: DynamoSite, tiny_bagel: Path) -> Iterator[Served]:
    worker = serve(site, tiny_bagel, BAGEL_DEPLOY, BAGEL)
    client = openai.OpenAI(base_url=site.processes[0].base_url + "/v1", api_key="unused", timeout=300)
    try:
        yield Served(site, worker, client, BAGEL, {})
    finally:
        client.close()
        statuses = site.stop([worker], how=signal.SIGTERM)
        assert statuses and set(statuses.values()) == {0}, statuses  # as systemd or Kubernetes stop it


class TestBagel:
    def test_chat_answers_with_an_image_and_in_text(self, bagel: Served) -> None:
        messages = [{"role": "user", "content": "a lighthouse at dusk"}]
        settings = {"size": "64x64", "num_inference_steps": 4, "cfg_text_scale": 4.0}
        chat = bagel.client.chat.completions.create(
            model=BAGEL, messages=messages, seed=2, extra_body={"chat_template_kwargs": settings}
        )
        (part,) = chat.choices[0].message.content
        assert uri_pixels(part["image_url"]["url"]).shape == (64, 64, 3)
        answer = bagel.client.chat.completions.create(
            model=BAGEL, messages=messages, max_tokens=8, temperature=0, extra_body={"modalities": ["text"]}
        )
        assert isinstance(answer.choices[0].message.content, str) and answer.choices[0].message.content
        assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 8
        streamed = bagel.client.chat.completions.create(
            model=BAGEL, messages=messages, max_tokens=8, temperature=0, stream=True,
            extra_body={"modalities": ["text"]},
        )  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == answer.choices[0].message.content
