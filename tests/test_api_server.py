"""The omni API server end to end: ``vllm serve <tiny GLM-Image> --omni`` through the stock ``vllm``
console script, driven with the official ``openai`` client (and httpx where a client cannot send it)."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from helpers import our_segments
from vllm_omni_testkit.harness.server import (
    ServerProcess,
    bin_script,
    cpu_test_env,
    free_port,
    wait_for_metric,
)

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parent.parent
DEPLOY = str(REPO / "deploy" / "tiny_glm_image_cpu.yaml")
MODEL = "tiny-glm-image"
UPLOAD_LIMIT = 256 * 1024
FAST = {"num_inference_steps": 4}
ENDLESS = 100_000
"""Steps of a request whose client goes away: it cannot end before it is aborted."""


@pytest.fixture(scope="module")
def server(tiny_glm_image: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    proc = ServerProcess(
        [
            bin_script("vllm"), "serve", str(tiny_glm_image), "--omni", "--deploy-config", DEPLOY,
            "--port", str(port), "--host", "127.0.0.1", "--served-model-name", MODEL,
            "--image-max-upload-bytes", str(UPLOAD_LIMIT), "--image-max-inference-steps", str(ENDLESS),
        ],
        port=port,
        log_path=tmp_path_factory.mktemp("api_server") / "server.log",
    )  # fmt: skip
    proc.start()
    try:
        proc.wait_ready(timeout=300)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300, max_retries=0)


def png_bytes(width: int = 64, height: int = 64, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def decode_b64(text: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(text)))
    image.load()
    return image


def assert_openai_error(body: object, status: int, param: str | None = None) -> str:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}; returns the message."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and isinstance(error["type"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


def stage_pids(server: ServerProcess) -> dict[str, list[int]]:
    health = httpx.get(server.base_url + "/health", timeout=10).json()
    return {sid: [r["pid"] for r in stage["replicas"]] for sid, stage in health["stages"].items()}


# --- happy paths -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "expected"), [("64x64", (64, 64)), ("128x64", (128, 64))])
def test_images_generations_n2(client: openai.OpenAI, size: str, expected: tuple[int, int]) -> None:
    result = client.images.generate(
        prompt="a red fox in the snow", n=2, size=size, extra_body={**FAST, "seed": 1}
    )
    assert len(result.data) == 2
    for item in result.data:
        image = decode_b64(item.b64_json)
        assert image.format == "PNG" and image.size == expected and image.mode == "RGB"
    assert result.size == size and result.output_format == "png"


def test_images_generations_output_format(client: openai.OpenAI) -> None:
    result = client.images.generate(prompt="a cat", size="64x64", output_format="jpeg", extra_body=FAST)
    assert decode_b64(result.data[0].b64_json).format == "JPEG"


def test_images_edits_with_uploaded_png(client: openai.OpenAI) -> None:
    result = client.images.edit(
        image=("source.png", png_bytes(), "image/png"), prompt="make it blue", size="64x64", extra_body=FAST
    )
    assert decode_b64(result.data[0].b64_json).size == (64, 64)
    # without size: the source's size
    result = client.images.edit(
        image=("wide.png", png_bytes(128, 64), "image/png"), prompt="make it blue", extra_body=FAST
    )
    assert decode_b64(result.data[0].b64_json).size == (128, 64)


def test_edit_that_cannot_fit_the_ar_stage_is_refused_with_the_numbers(client: openai.OpenAI) -> None:
    """Four 256x256 sources (64 tokens each: the tiny processor's max_pixels is 256^2, halved, 16-pixel
    patches) and a 960x960 image (901 tokens) overrun max_model_len 1024 only together."""
    sources = [(f"source{i}.png", png_bytes(256, 256), "image/png") for i in range(4)]
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(image=sources, prompt="make it blue", size="960x960", extra_body=FAST)
    message = assert_openai_error({"error": info.value.body}, 400, "size")
    assert "max_model_len 1024" in message
    assert "source images 256 (64, 64, 64, 64) + generated 901 (a 960x960 image)" in message
    assert "ask for at most 864x864" in message


def data_uri_image(content: object) -> Image.Image:
    """The image of a chat answer as vllm-omni's clients read it: ``content[0]["image_url"]["url"]``."""
    assert isinstance(content, list) and content[0]["type"] == "image_url", content
    url = content[0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,"), url[:80]
    return decode_b64(url.removeprefix("data:image/png;base64,"))


def test_chat_completions_text_to_image(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a photo of a cat"}],
        extra_body={"modalities": ["image"], "size": "128x64", "seed": 0, **FAST},
    )
    assert response.model == MODEL and len(response.choices) == 1
    assert data_uri_image(response.choices[0].message.content).size == (128, 64)


def test_chat_completions_image_to_image(client: openai.OpenAI) -> None:
    uri = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    response = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "make it blue"},
                    {"type": "image_url", "image_url": {"url": uri}},
                ],
            }
        ],
        extra_body={"modalities": ["image"], "height": 64, "width": 64, **FAST},
    )
    assert data_uri_image(response.choices[0].message.content).size == (64, 64)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_health_reports_every_stage(server: ServerProcess) -> None:
    response = httpx.get(server.base_url + "/health", timeout=10)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert {sid: s["name"] for sid, s in body["stages"].items()} == {"0": "ar", "1": "dit"}
    for stage in body["stages"].values():
        assert stage["healthy"] is True
        for replica in stage["replicas"]:
            assert replica["state"] == "ready" and isinstance(replica["pid"], int)
            assert replica["pid"] != server.proc.pid  # both stages run in processes of their own


def test_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    client.images.generate(prompt="a lake", size="64x64", extra_body=FAST)
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for name in (
        "omni_stage_queue_depth{",
        "omni_stage_latency_seconds_bucket{",
        "omni_request_latency_seconds_bucket{",
        "omni_images_generated_total{",
        "omni_connector_bytes_total{",
        "omni_connector_errors_total{",
        "vllm:",  # vLLM's own metrics, from the AR stage's engine
    ):
        assert name in text, name
    generated = [line for line in text.splitlines() if line.startswith("omni_images_generated_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in generated) >= 1


def test_sixteen_concurrent_requests(server: ServerProcess) -> None:
    async def main() -> list[openai.types.ImagesResponse]:
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", timeout=300
        ) as aclient:
            return await asyncio.gather(
                *(
                    aclient.images.generate(
                        prompt=f"fox number {i}", size="64x64", extra_body={**FAST, "seed": i}
                    )
                    for i in range(16)
                )
            )

    results = asyncio.run(main())
    assert len(results) == 16
    assert all(decode_b64(r.data[0].b64_json).size == (64, 64) for r in results)


# --- bad requests ------------------------------------------------------------------------------------


def test_malformed_json(server: ServerProcess) -> None:
    response = httpx.post(
        server.base_url + "/v1/images/generations",
        content=b'{"prompt": "a cat", ',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert "JSON" in assert_openai_error(response.json(), 400)


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"extra_body": {"colour": "red"}}, "colour", "unknown field"),
        ({"size": "64x50"}, "size", "multiples of 32"),
        ({"size": "abc"}, "size", "WIDTHxHEIGHT"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": 11}, "n", "less than or equal to 10"),
        ({"response_format": "url"}, "response_format", "--image-media-dir"),
        ({"size": "4096x4096"}, "size", "at most 2048"),
        ({"extra_body": {"num_inference_steps": ENDLESS + 1}}, "num_inference_steps", f"at most {ENDLESS}"),
    ],
)
def test_bad_generation_requests(client: openai.OpenAI, kwargs: dict, param: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a cat", **kwargs)
    assert info.value.status_code == 400
    assert message in assert_openai_error({"error": info.value.body}, 400, param)


def test_undecodable_upload(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(image=("notes.png", b"this is not an image", "image/png"), prompt="x")
    assert "cannot decode" in assert_openai_error({"error": info.value.body}, 400, "image")


def test_oversized_upload(client: openai.OpenAI) -> None:
    big = os.urandom(UPLOAD_LIMIT + 1)
    with pytest.raises(openai.APIStatusError) as info:
        client.images.edit(image=("big.png", big, "image/png"), prompt="x")
    assert info.value.status_code == 413
    message = assert_openai_error({"error": info.value.body}, 413, "image")
    assert f"{UPLOAD_LIMIT + 1} bytes" in message and f"at most {UPLOAD_LIMIT} bytes" in message


def test_chat_without_image_modality(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}])
    assert "generates images" in assert_openai_error({"error": info.value.body}, 400, "modalities")


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.images.generate(prompt="a cat", model="dall-e-3", size="64x64")
    assert_openai_error({"error": info.value.body}, 404, "model")


# --- a client that goes away, a dying stage ---------------------------------------------------------


def test_client_disconnect_aborts_the_request_in_every_stage(server: ServerProcess) -> None:
    """The client goes away once its request is being denoised: the DiT drops it from its batch (which
    it reports after its last step count), and the steps counter stops short and stays still."""
    steps = server.metric("omni_diffusion_denoise_steps_total")
    drops = server.metric("omni_stage_aborted_requests_total", stage="1", where="batch")

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
            body = {"prompt": "a painting nobody waits for", "size": "64x64", "num_inference_steps": ENDLESS}
            with server.hold("dit.step") as hold:  # the DiT holds its batch after the first step
                work = asyncio.ensure_future(client.post("/v1/images/generations", json=body))
                await asyncio.to_thread(hold.wait, alive=server.alive)
                work.cancel()  # the client closes its connection while its request is being denoised
                with pytest.raises(asyncio.CancelledError):
                    await work

    asyncio.run(main())
    wait_for_metric(
        lambda sample: server.metric(sample, stage="1", where="batch"),
        "omni_stage_aborted_requests_total",
        drops + 1,
    )
    assert "went away; aborted 1 request(s)" in server.log_text()
    stages = httpx.get(server.base_url + "/health", timeout=10).json()["stages"]
    assert all(r["inflight"] == 0 for s in stages.values() for r in s["replicas"])
    stopped_at = server.metric("omni_diffusion_denoise_steps_total")
    assert stopped_at - steps < ENDLESS  # dropped from the DiT's batch, not run to its end
    time.sleep(1.0)
    assert server.metric("omni_diffusion_denoise_steps_total") == stopped_at


def test_killed_diffusion_proc_is_retried_on_the_restarted_replica(server: ServerProcess) -> None:
    base = server.base_url
    (old_pid,) = stage_pids(server)["1"]
    outcome: dict[str, httpx.Response] = {}
    steps = 20  # the hold keeps it in the DiT until it is killed

    def slow_request() -> None:
        outcome["response"] = httpx.post(
            base + "/v1/images/generations",
            json={"prompt": "a very slow painting", "size": "64x64", "num_inference_steps": steps},
            timeout=300,
        )

    thread = threading.Thread(target=slow_request)
    with server.hold("dit.step") as hold:  # one-shot: the restarted replica does not hold the retry
        thread.start()
        hold.wait(alive=server.alive)
        os.kill(old_pid, signal.SIGKILL)  # while it denoises the request
    thread.join(300)
    response = outcome["response"]
    assert response.status_code == 200, response.text  # ran again on the restarted replica
    assert decode_b64(response.json()["data"][0]["b64_json"]).size == (64, 64)
    health = httpx.get(base + "/health", timeout=10)
    assert health.status_code == 200
    replica = health.json()["stages"]["1"]["replicas"][0]
    assert replica["restarts"] == 1 and replica["pid"] != old_pid
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert 'omni_stage_retries_total{name="dit",stage="1"} 1.0' in metrics
    assert 'omni_stage_replica_deaths_total{name="dit",stage="1"} 1.0' in metrics


# --- command line ------------------------------------------------------------------------------------


def test_busy_port_exits_2(server: ServerProcess, tiny_glm_image: Path) -> None:
    result = subprocess.run(
        [bin_script("vllm"), "serve", str(tiny_glm_image), "--omni", "--deploy-config", DEPLOY,
         "--port", str(server.port), "--host", "127.0.0.1"],
        capture_output=True, text=True, env=cpu_test_env(drop=("VLLM_PLUGINS",)), timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "already in use" in errors[0], result.stderr[-3000:]
    assert " ready" not in result.stderr and "Traceback" not in result.stderr


# --- shutdown (last: it stops the module's server) -----------------------------------------------------


def test_sigterm_drains_in_flight_requests_and_exits_0(server: ServerProcess) -> None:
    base = server.base_url
    pids = [pid for stage in stage_pids(server).values() for pid in stage] + [server.proc.pid]
    outcome: dict[str, httpx.Response] = {}

    def in_flight() -> None:
        outcome["response"] = httpx.post(
            base + "/v1/images/generations",
            json={"prompt": "the last painting", "size": "64x64", "num_inference_steps": 20},
            timeout=300,
        )

    thread = threading.Thread(target=in_flight)
    with server.hold("dit.step") as hold:
        thread.start()
        hold.wait(alive=server.alive)
        server.proc.send_signal(signal.SIGTERM)  # while the DiT holds the request; released on leaving
    thread.join(120)
    assert outcome["response"].status_code == 200  # finished, not dropped
    assert server.proc.wait(120) == 0
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "a stage process outlived the server"
    assert our_segments(set(pids)) == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/health", timeout=5)
