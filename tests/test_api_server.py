"""The omni API server end to end, on one served tiny GLM-Image (``vllm serve <tiny GLM-Image> --omni``
through the stock ``vllm`` console script), driven with the official ``openai`` client (and httpx where a
client cannot send it): the endpoints' answers and refusals; streamed answers (the AR stage's progress
before the previews, chat's image as a content part); faults: a client that goes away in either stage
has its request aborted in every stage with no image made, a stage process killed under load loses no
request and changes no image, ten AR engine restarts leave the endpoints of one, a request that kills
its stage every time is quarantined after its budget, a CI-sized soak; the command line; SIGTERM with a
request in each stage, leaving nothing (the shared-memory deployment's SIGTERM of ``test_stops.py``).

One server for all of them (each start of one costs CPU time across its processes). Tests run in file
order: those that count from a fresh server (its first DiT death, retry and restart; its first
quarantine) come before the faults that add to those counts, and the SIGTERM test is last."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from helpers import assert_streamed, pixels, wait_for
from vllm_omni_plugin.runtime_dir import SEGMENTS_FILE
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.forks import run_to_end
from vllm_omni_testkit.harness.leaks import LeakWatch
from vllm_omni_testkit.harness.served_reference import GLM_IMAGE
from vllm_omni_testkit.harness.server import (
    ServerProcess,
    bin_script,
    cpu_test_env,
    free_port,
    wait_for_metric,
)
from vllm_omni_testkit.harness.soak import Deployment, SoakSettings, run_soak

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parent.parent
DEPLOY = str(REPO / "deploy" / "tiny_glm_image_cpu.yaml")
MODEL = "tiny-glm-image"
UPLOAD_LIMIT = 256 * 1024
"""Above the soak's edits' sources (64x64 PNGs of random pixels, about 12 KB)."""
GENERATIONS = "/v1/images/generations"
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
        GLM_IMAGE.of(proc, tmp_path_factory)  # the run's GLM-Image reference, unless a module made it
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
    health = http_client.get(server.base_url + "/health", timeout=10).json()
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
    response = http_client.get(server.base_url + "/health", timeout=10)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert {sid: s["name"] for sid, s in body["stages"].items()} == {"0": "ar", "1": "dit"}
    for stage in body["stages"].values():
        assert stage["healthy"] is True
        for replica in stage["replicas"]:
            assert replica["state"] == "ready" and isinstance(replica["pid"], int)
            assert replica["pid"] != server.proc.pid  # both stages run in processes of their own
    # the stages started side by side: the DiT's process ran (and loaded) while the AR engine started
    log = server.log_text()
    assert log.index("stage 1 (dit) replica 0 launched") < log.index("stage 0 (ar) replica 0 starting")


def test_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    client.images.generate(prompt="a lake", size="64x64", extra_body=FAST)
    text = http_client.get(server.base_url + "/metrics", timeout=10).text
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


def test_vllm_bench_serve_omni_reads_both_stages_times(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``vllm bench serve --omni`` on the two-stage GLM-Image: its saved result matches what ran (the
    server counted exactly its images) and gives each stage's mean time from /metrics."""
    from vllm_omni_plugin.bench.serve import main as bench_main

    before = server.metric("omni_images_generated_total")
    argv = ["--omni", "--base-url", server.base_url, "--num-prompts", "3", "--size", "64x64",
            "--num-inference-steps", "4", "--save-result", "--result-dir", str(tmp_path)]  # fmt: skip
    assert bench_main(argv) == 0
    assert "Serving Benchmark Result (images)" in capsys.readouterr().out
    (path,) = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    assert (result["completed"], result["failed"], result["total_images"]) == (3, 0, 3)
    assert server.metric("omni_images_generated_total") - before == 3
    assert result["server"]["mean_stage_0:ar_ms"] > 0 and result["server"]["mean_stage_1:dit_ms"] > 0


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


# --- streamed answers ---------------------------------------------------------------------------------


def test_glm_image_streams_its_ar_progress_before_its_previews(client: openai.OpenAI) -> None:
    ask = {"model": MODEL, "prompt": "a red fox", "size": "64x64"}
    extra = {"seed": 3, "num_inference_steps": 4}
    plain = pixels(client.images.generate(**ask, extra_body=extra).data[0].b64_json)
    events = list(client.images.generate(**ask, stream=True, partial_images=2, extra_body=extra))
    before = assert_streamed(events, "image_generation", 2, plain)
    progress = [(e.tokens, e.total) for e in before]
    assert before and all(e.type == "image_generation.progress" for e in before)
    total = progress[0][1]
    assert progress[-1] == (total, total) and [t for t, _ in progress] == sorted(t for t, _ in progress)


def test_chat_streams_the_image_as_a_content_part(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "a red fox"}]
    extra = {"modalities": ["image"], "size": "64x64", "seed": 3, "num_inference_steps": 4}
    (plain,) = client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra).choices
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 extra_body=extra))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    parts = [c.choices[0].delta.content for c in chunks if isinstance(c.choices[0].delta.content, list)]
    assert len(parts) == 1 and parts[0][0]["type"] == "image_url"
    assert parts[0][0]["image_url"]["url"] == plain.message.content[0]["image_url"]["url"]
    assert chunks[-1].choices[0].finish_reason == "stop"


# --- bad requests ------------------------------------------------------------------------------------


def test_malformed_json(server: ServerProcess) -> None:
    response = http_client.post(
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


# --- a client that goes away, a dying stage (before the faults below: counts from a fresh server) ----


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
    stages = http_client.get(server.base_url + "/health", timeout=10).json()["stages"]
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
        outcome["response"] = http_client.post(
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
    health = http_client.get(base + "/health", timeout=10)
    assert health.status_code == 200
    replica = health.json()["stages"]["1"]["replicas"][0]
    assert replica["restarts"] == 1 and replica["pid"] != old_pid
    metrics = http_client.get(base + "/metrics", timeout=10).text
    assert 'omni_stage_retries_total{name="dit",stage="1"} 1.0' in metrics
    assert 'omni_stage_replica_deaths_total{name="dit",stage="1"} 1.0' in metrics


# --- faults: stage deaths ------------------------------------------------------------------------------


def health(server: ServerProcess) -> dict[str, Any]:
    return http_client.get(server.base_url + "/health", timeout=30).json()


def replica(server: ServerProcess, stage: str) -> dict[str, Any]:
    return health(server)["stages"][stage]["replicas"][0]


def body(i: int) -> dict[str, Any]:
    """Request ``i`` of the 24: a quarter of them long (bigger, many more steps)."""
    long = i % 4 == 0
    size = "256x256" if long else "64x64"
    return {"model": MODEL, "prompt": f"fox number {i}", "size": size, "seed": i,
            "num_inference_steps": 120 if long else 4}  # fmt: skip


def decode(response: httpx.Response) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
    return np.asarray(image.convert("RGB"))


async def post_all(server: ServerProcess, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
        return list(await asyncio.gather(*(client.post(GENERATIONS, json=b) for b in bodies)))


HOLD_POINT = {"0": "ar.step", "1": "dit.step"}
"""Where work is held in each stage (``vllm_omni_plugin.test_hooks``)."""


def run_with_kill(server: ServerProcess, stage: str, min_inflight: int) -> tuple[list[httpx.Response], int]:
    """The 24 requests, with the stage's process (the DiT process, the AR engine core) SIGKILLed while
    it holds work at its hold point and ``min_inflight`` of them are in flight there; (responses,
    killed pid)."""

    async def main() -> tuple[list[httpx.Response], int]:
        with server.hold(HOLD_POINT[stage]) as hold:
            work = asyncio.ensure_future(post_all(server, [body(i) for i in range(24)]))

            def kill() -> int:
                hold.wait(alive=server.alive)  # nothing leaves the stage from here on
                wait_for(
                    lambda: replica(server, stage)["inflight"] >= min_inflight, 600, f"stage {stage} load"
                )
                pid = replica(server, stage)["pid"]
                os.kill(pid, signal.SIGKILL)
                return pid

            pid = await asyncio.to_thread(kill)
        return await work, pid

    return asyncio.run(main())


def assert_same_images(responses: list[httpx.Response], reference: list[np.ndarray]) -> None:
    assert [r.status_code for r in responses] == [200] * len(reference), [r.text[:200] for r in responses]
    for i, (response, expected) in enumerate(zip(responses, reference, strict=True)):
        got = decode(response)
        assert got.shape == expected.shape, i
        # <= 1/255: batch composition changes kernels' rounding (diffusion engine docs), as between any two runs
        assert int(np.abs(got.astype(int) - expected.astype(int)).max()) <= 1, i


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> list[np.ndarray]:
    """The 24 requests' images, undisturbed."""
    responses = asyncio.run(post_all(server, [body(i) for i in range(24)]))
    assert all(r.status_code == 200 for r in responses), [r.text[:200] for r in responses]
    return [decode(r) for r in responses]


@pytest.mark.parametrize(("stage", "name", "min_inflight"), [("1", "dit", 2), ("0", "ar", 8)])
def test_a_stage_killed_under_24_requests_loses_none_and_changes_no_image(
    server: ServerProcess, reference: list[np.ndarray], stage: str, name: str, min_inflight: int
) -> None:
    labels = {"stage": stage, "name": name}
    deaths = server.metric("omni_stage_replica_deaths_total", **labels)
    retries = server.metric("omni_stage_retries_total", **labels)
    restarts = replica(server, stage)["restarts"]
    removed = f"stage {stage} ({name}) replica 0: removed"
    removed_before = server.log_text().count(removed)  # an earlier death of this server's stage logged some
    responses, killed = run_with_kill(server, stage, min_inflight)
    assert_same_images(responses, reference)
    after = replica(server, stage)
    assert after["restarts"] == restarts + 1 and after["pid"] != killed and after["state"] == "ready"
    assert server.metric("omni_stage_replica_deaths_total", **labels) == deaths + 1
    assert server.metric("omni_stage_retries_total", **labels) >= retries + 1  # at least one was in flight
    assert server.metric("omni_stage_retries_exhausted_total", **labels) == 0
    assert server.log_text().count(removed) > removed_before  # what the dead one left


def test_ten_ar_engine_restarts_leave_the_endpoints_of_one(server: ServerProcess) -> None:
    """Each restart of the AR engine starts in an emptied directory of its own (``runtime_dir.py``): after
    SIGKILLs of the engine core up to its tenth restart, each found by the next request (retried, answered
    200), the engine's IPC endpoints (and temp files) are as many as after its first start or restart (the
    module's AR kill under 24 requests, run before, is one of the ten), none of them a predecessor's."""
    assert server.proc is not None
    temp = server.env["TMPDIR"]
    (runtime,) = [n for n in os.listdir(temp) if n.startswith(f"vllm-omni-{server.proc.pid}-")]
    engine_dir = os.path.join(temp, runtime, "ar0-0")
    first = sorted(os.listdir(engine_dir))
    assert len([n for n in first if re.fullmatch(r"[0-9a-f-]{36}", n)]) >= 5, first  # vLLM's ZMQ endpoints
    counts, previous = [], first
    small = {"model": MODEL, "prompt": "a fox", "size": "64x64", "seed": 0, "num_inference_steps": 1}
    kills = 10 - replica(server, "0")["restarts"]
    assert kills >= 9, kills  # at most one restart before: the endpoints of the first one are compared
    for _ in range(kills):
        before = replica(server, "0")
        os.kill(before["pid"], signal.SIGKILL)
        response = http_client.post(server.base_url + GENERATIONS, json=small, timeout=300)
        assert response.status_code == 200, response.text  # run again on the restarted engine
        now_replica = replica(server, "0")
        assert now_replica["restarts"] == before["restarts"] + 1 and now_replica["state"] == "ready"
        now = sorted(os.listdir(engine_dir))
        counts.append(len(now))
        assert set(now) & set(previous) == {SEGMENTS_FILE}, "the previous engine's endpoints are still there"
        previous = now
    assert counts == [len(first)] * kills, (len(first), counts)
    assert replica(server, "0")["restarts"] == 10


def test_a_request_that_kills_its_stage_every_time_is_quarantined_after_its_budget(
    server: ServerProcess,
) -> None:
    """Its first death runs it again alone; dying alone as well, it is failed as the culprit: 500 (a
    client must not retry it), never run with other requests again."""
    restarts = replica(server, "1")["restarts"]
    killed: list[int] = []

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
            with server.hold("dit.step") as hold:
                work = asyncio.ensure_future(
                    client.post(GENERATIONS, json={**body(1), "num_inference_steps": 20})
                )
                for _ in range(2):  # kill the DiT process whenever it holds the request
                    await asyncio.to_thread(hold.wait, alive=server.alive)
                    pid = (await asyncio.to_thread(replica, server, "1"))["pid"]
                    hold.rearm()  # its restarted replica holds the retried request too
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                return await work

    response = asyncio.run(main())
    assert response.status_code == 500, response.text
    message = response.json()["error"]["message"]
    assert "stage 1's process died while running this request alone" in message
    assert "2 deaths, max_retries 1" in message
    assert len(killed) == 2
    log = server.log_text()
    (line,) = [ln for ln in log.splitlines() if "quarantined after 2 replica death(s)" in ln]
    assert re.search(r"request [0-9a-f]{32}: quarantined", line) and line.count("died (exit code -9)") == 2
    assert server.metric("omni_stage_quarantined_requests_total", stage="1", name="dit") == 1
    assert server.metric("omni_stage_retries_exhausted_total", stage="1", name="dit") == 0
    wait_for(lambda: replica(server, "1")["state"] == "ready", 120, "the DiT to come back")
    assert replica(server, "1")["restarts"] == restarts + 2
    after = http_client.post(server.base_url + GENERATIONS, json=body(2), timeout=300)
    assert after.status_code == 200, after.text


# --- faults: clients that go away in either stage ------------------------------------------------------


def aborted(server: ServerProcess, stage: str, where: str) -> float:
    name = {"0": "ar", "1": "dit"}[stage]
    return server.metric("omni_stage_aborted_requests_total", stage=stage, name=name, where=where)


def images_made(server: ServerProcess) -> float:
    return server.metric("omni_images_generated_total", endpoint="images/generations")


def test_a_client_gone_during_the_ar_stage_aborts_its_request_in_every_stage(server: ServerProcess) -> None:
    disconnects = server.metric("omni_client_disconnects_total", endpoint="images/generations")
    engine, images = aborted(server, "0", "engine"), images_made(server)
    tokens = server.metric("vllm:generation_tokens_total")
    discarded = server.metric("omni_stage_discarded_outputs_total", stage="1", name="dit")
    dit_drops = aborted(server, "1", "queue") + aborted(server, "1", "batch")
    ar_tokens = 721  # a 768x768 image: 576 + 144 + 1 AR tokens, long enough to be caught in the AR stage

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
            with server.hold("ar.step") as hold:  # the AR engine holds it after its first step
                work = asyncio.ensure_future(client.post(GENERATIONS, json={**body(3), "size": "768x768"}))
                await asyncio.to_thread(hold.wait, alive=server.alive)
                work.cancel()  # the client closes its connection while the request is in the AR engine
                with pytest.raises(asyncio.CancelledError):
                    await work

    asyncio.run(main())
    wait_for(lambda: aborted(server, "0", "engine") == engine + 1, 30, "the AR engine's abort")
    assert replica(server, "0")["inflight"] == 0 and replica(server, "1")["inflight"] == 0
    assert server.metric("omni_client_disconnects_total", endpoint="images/generations") == disconnects + 1
    time.sleep(3.0)  # longer than the whole AR stage of this request takes here: nothing comes later
    assert (
        server.metric("vllm:generation_tokens_total") - tokens < ar_tokens
    )  # the engine stopped decoding it
    assert (
        aborted(server, "1", "queue") + aborted(server, "1", "batch") == dit_drops
    )  # it never reached the DiT
    assert images_made(server) == images
    assert server.metric("omni_stage_discarded_outputs_total", stage="1", name="dit") == discarded


def test_clients_gone_during_the_dit_stage_are_dropped_from_its_queue_and_its_batch(
    server: ServerProcess,
) -> None:
    queue, batch, images = aborted(server, "1", "queue"), aborted(server, "1", "batch"), images_made(server)
    discarded = server.metric("omni_stage_discarded_outputs_total", stage="1", name="dit")
    disconnects = server.metric("omni_client_disconnects_total", endpoint="images/generations")

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
            with server.hold("dit.step") as hold:
                running = asyncio.ensure_future(
                    client.post(GENERATIONS, json={**body(5), "num_inference_steps": ENDLESS})
                )
                await asyncio.to_thread(hold.wait, alive=server.alive)  # its batch has started
                # held after a step, the loop admits nothing: another request waits in the DiT process's
                # queue, and its abort (applied by the process's reader thread) drops it from there
                queued = asyncio.ensure_future(client.post(GENERATIONS, json={**body(6), "size": "128x64"}))
                await asyncio.to_thread(
                    wait_for, lambda: replica(server, "1")["inflight"] >= 2, 600, "the queue"
                )
                queued.cancel()
                await asyncio.to_thread(
                    wait_for, lambda: aborted(server, "1", "queue") == queue + 1, 30, "a queue drop"
                )
            running.cancel()
            for task in (queued, running):
                with pytest.raises(asyncio.CancelledError):
                    await task

    asyncio.run(main())
    wait_for(lambda: aborted(server, "1", "batch") == batch + 1, 30, "the batch drop")
    assert replica(server, "1")["inflight"] == 0
    assert server.metric("omni_client_disconnects_total", endpoint="images/generations") == disconnects + 2
    time.sleep(1.0)
    assert images_made(server) == images  # no image was made for either
    assert server.metric("omni_stage_discarded_outputs_total", stage="1", name="dit") == discarded
    after = http_client.post(server.base_url + GENERATIONS, json=body(7), timeout=300)
    assert after.status_code == 200, after.text


# --- soak (it kills a stage) -----------------------------------------------------------------------------


def test_ci_sized_soak(server: ServerProcess) -> None:
    assert server.proc is not None
    deployment = Deployment(server.base_url, server.proc.pid, MODEL)
    report = run_soak(deployment, SoakSettings(requests=150, concurrency=8, kills={75: "dit"}))
    text = report.format()
    print(text)
    assert not report.unexpected, text
    assert sum(report.outcomes.values()) == 150 and len(report.kills) == 1, text
    assert report.segment_growth <= 0 and report.uncollected_values == 0, text
    assert report.sample("end").segments.get("pool held", 0) <= 8, (
        text
    )  # views in flight, at most one a request


# --- command line ------------------------------------------------------------------------------------


def test_busy_port_exits_2(server: ServerProcess, tiny_glm_image: Path) -> None:
    result = run_to_end(
        [bin_script("vllm"), "serve", str(tiny_glm_image), "--omni", "--deploy-config", DEPLOY,
         "--port", str(server.port), "--host", "127.0.0.1"],
        cpu_test_env(drop=("VLLM_PLUGINS",)), timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "already in use" in errors[0], result.stderr[-3000:]
    assert " ready" not in result.stderr and "Traceback" not in result.stderr


# --- shutdown (last: it stops the module's server) -----------------------------------------------------


def test_sigterm_drains_in_flight_requests_and_exits_0(server: ServerProcess) -> None:
    """SIGTERM at the main process (as ``kill`` or systemd send it) with a request in each stage: one held
    in the DiT from its first step, then one whose 256x256 image makes the AR stage's longest run (in
    the AR stage, or queued behind the held DiT batch). Both are answered 200 (drained, not dropped),
    the server exits 0, and nothing of the deployment is left: no process, no segment it mapped
    (``psm_*`` and semaphores included), not its runtime directory. This server is the shared-memory
    deployment's A of ``test_stops.py`` (the other stops are there): its AR engine was killed under load
    (``test_a_stage_killed_under_24_requests_...``) and restarted ten times before."""
    assert server.proc is not None
    base, temp = server.base_url, server.env["TMPDIR"]
    (runtime,) = [n for n in os.listdir(temp) if n.startswith(f"vllm-omni-{server.proc.pid}-")]
    watch = LeakWatch(root=server.proc.pid, only_new=False).start()
    watch.poll()  # the processes and segments of the deployment now
    bodies = {
        "dit": {"prompt": "the last painting", "size": "64x64", "num_inference_steps": 20},
        "ar": {"prompt": "a big painting", "size": "256x256", "num_inference_steps": 2},
    }
    statuses: dict[str, int | str] = {}

    def send(name: str) -> None:
        try:
            statuses[name] = http_client.post(base + GENERATIONS, json=bodies[name], timeout=300).status_code
        except httpx.HTTPError as exc:
            statuses[name] = type(exc).__name__

    def inflight() -> int:
        stages = http_client.get(base + "/health", timeout=30).json()["stages"]
        return sum(replica["inflight"] for stage in stages.values() for replica in stage["replicas"])

    threads = {name: threading.Thread(target=send, args=(name,)) for name in bodies}
    try:
        with server.hold("dit.step") as hold:
            threads["dit"].start()
            hold.wait(alive=server.alive)
            threads["ar"].start()
            wait_for(lambda: inflight() >= len(bodies), 300, "both requests inside the stages")
            watch.poll()
            server.proc.send_signal(signal.SIGTERM)  # while the DiT holds one; released on leaving
        for thread in threads.values():
            thread.join(300)
        assert statuses == {"dit": 200, "ar": 200}  # finished, not dropped
        assert server.proc.wait(120) == 0, server.log_text()[-3000:]
        left = watch.leftovers(grace=30)
        assert not left, left.describe()
    finally:
        watch.stop()
    assert runtime not in os.listdir(temp)
    with pytest.raises(httpx.ConnectError):
        http_client.get(base + "/health", timeout=5)
