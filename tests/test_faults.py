"""Faults on a served deployment (``vllm serve <tiny GLM-Image> --omni``, real HTTP clients): a stage
process killed under load loses no request and changes no image, a request that kills its stage every
time gets 503 after its budget, a client that goes away in either stage has its request aborted in every
stage with no image made, and a CI-sized soak."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from helpers import wait_for
from vllm_omni_plugin.runtime_dir import SEGMENTS_FILE
from vllm_omni_testkit.harness.server import ServerProcess, bin_script, free_port
from vllm_omni_testkit.harness.soak import Deployment, SoakSettings, run_soak

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parent.parent
DEPLOY = str(REPO / "deploy" / "tiny_glm_image_cpu.yaml")
MODEL = "tiny-glm-image"
GENERATIONS = "/v1/images/generations"
ENDLESS = 100_000
"""Steps of a request that is only ever cancelled: it cannot end before the test is done with it."""


@pytest.fixture(scope="module")
def server(tiny_glm_image: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    proc = ServerProcess(
        [bin_script("vllm"), "serve", str(tiny_glm_image), "--omni", "--deploy-config", DEPLOY,
         "--port", str(port), "--host", "127.0.0.1", "--served-model-name", MODEL,
         "--image-max-inference-steps", str(ENDLESS)],
        port=port,
        log_path=tmp_path_factory.mktemp("faults") / "server.log",
    )  # fmt: skip
    with proc:
        proc.wait_ready(timeout=300)
        yield proc


# --- helpers ------------------------------------------------------------------------------------------


def health(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(server.base_url + "/health", timeout=30).json()


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


# --- stage deaths -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("stage", "name", "min_inflight"), [("1", "dit", 2), ("0", "ar", 8)])
def test_a_stage_killed_under_24_requests_loses_none_and_changes_no_image(
    server: ServerProcess, reference: list[np.ndarray], stage: str, name: str, min_inflight: int
) -> None:
    labels = {"stage": stage, "name": name}
    deaths = server.metric("omni_stage_replica_deaths_total", **labels)
    retries = server.metric("omni_stage_retries_total", **labels)
    restarts = replica(server, stage)["restarts"]
    responses, killed = run_with_kill(server, stage, min_inflight)
    assert_same_images(responses, reference)
    after = replica(server, stage)
    assert after["restarts"] == restarts + 1 and after["pid"] != killed and after["state"] == "ready"
    assert server.metric("omni_stage_replica_deaths_total", **labels) == deaths + 1
    assert server.metric("omni_stage_retries_total", **labels) >= retries + 1  # at least one was in flight
    assert server.metric("omni_stage_retries_exhausted_total", **labels) == 0
    assert f"stage {stage} ({name}) replica 0: removed" in server.log_text()  # what the dead one left


def test_ten_ar_engine_restarts_leave_the_endpoints_of_one(server: ServerProcess) -> None:
    """Each restart of the AR engine starts in an emptied directory of its own (``runtime_dir.py``): after
    ten SIGKILLs of the engine core, each found by the next request (retried, answered 200), the engine's
    IPC endpoints (and temp files) are as many as after one start, none of them a predecessor's."""
    assert server.proc is not None
    temp = server.env["TMPDIR"]
    (runtime,) = [n for n in os.listdir(temp) if n.startswith(f"vllm-omni-{server.proc.pid}-")]
    engine_dir = os.path.join(temp, runtime, "ar0-0")
    first = sorted(os.listdir(engine_dir))
    assert len([n for n in first if re.fullmatch(r"[0-9a-f-]{36}", n)]) >= 5, first  # vLLM's ZMQ endpoints
    counts, previous = [], first
    small = {"model": MODEL, "prompt": "a fox", "size": "64x64", "seed": 0, "num_inference_steps": 1}
    for _ in range(10):
        before = replica(server, "0")
        os.kill(before["pid"], signal.SIGKILL)
        response = httpx.post(server.base_url + GENERATIONS, json=small, timeout=300)
        assert response.status_code == 200, response.text  # run again on the restarted engine
        now_replica = replica(server, "0")
        assert now_replica["restarts"] == before["restarts"] + 1 and now_replica["state"] == "ready"
        now = sorted(os.listdir(engine_dir))
        counts.append(len(now))
        assert set(now) & set(previous) == {SEGMENTS_FILE}, "the previous engine's endpoints are still there"
        previous = now
    assert counts == [len(first)] * 10, (len(first), counts)


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
    after = httpx.post(server.base_url + GENERATIONS, json=body(2), timeout=300)
    assert after.status_code == 200, after.text


# --- clients that go away -------------------------------------------------------------------------------


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
            # another size: it cannot join the running (endless) batch and waits in the DiT process's queue
            queued = asyncio.ensure_future(client.post(GENERATIONS, json={**body(6), "size": "128x64"}))
            await asyncio.to_thread(wait_for, lambda: replica(server, "1")["inflight"] >= 2, 600, "the queue")
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
    after = httpx.post(server.base_url + GENERATIONS, json=body(7), timeout=300)
    assert after.status_code == 200, after.text


# --- soak (last: it kills a stage) ----------------------------------------------------------------------


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
