"""``batching: loop`` served: the tiny SD3 behind ``vllm serve --omni`` with one step loop over every
admitted request and ``scheduling_policy: priority``, its finished requests decoded beside the next step
(``overlap_decode: true``, a GPU's default; the other served tests decode between steps, a CPU's). The
tests step the loop with the ``dit.step`` hold
point (it holds after each step, naming the requests that step ran), so what they see does not depend on
the machine's speed:

- a short request sent while a long one runs joins it, finishes while the long one still runs, and gets
  the image it gets alone (diffusers' own call);
- a request of better priority preempts the running ones between steps and runs as if alone; the
  preempted ones resume and all get their images alone; ``/metrics`` counts the preemptions;
- requests the loop runs as whole requests (previews) get diffusers' image too, and concurrent requests
  each get theirs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import assert_streamed, pixels
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.server import ServerProcess, bin_script, free_port
from vllm_omni_testkit.holds import Hold
from vllm_omni_testkit.reference.diffusers import reference_image

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore::FutureWarning")]

DEPLOY = """\
pipeline: diffusion
stages:
  - stage_id: 0
    max_batch_size: 2
    batching: loop
    batch_wait_ms: 0
    scheduling_policy: priority
    overlap_decode: true
"""
GUIDANCE = 4.0


@pytest.fixture(scope="module")
def server(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("loop_serve")
    (tmp / "deploy.yaml").write_text(DEPLOY)
    port = free_port()
    argv = [bin_script("vllm"), "serve", str(tiny_sd3), "--omni", "--deploy-config", str(tmp / "deploy.yaml"),
            "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
    with ServerProcess(argv, port=port, log_path=tmp / "server.log") as served:
        served.wait_ready(timeout=300)
        yield served


def body(prompt: str, seed: int, steps: int, priority: int = 0) -> dict[str, Any]:
    return {"prompt": prompt, "size": "64x64", "seed": seed, "num_inference_steps": steps,
            "guidance_scale": GUIDANCE, "priority": priority}  # fmt: skip


def generate(server: ServerProcess, request: dict[str, Any]) -> np.ndarray:
    answer = http_client.post(server.base_url + "/v1/images/generations", json=request, timeout=600)
    assert answer.status_code == 200, answer.text
    return pixels(answer.json()["data"][0]["b64_json"])


def alone(tiny_sd3: Path, request: dict[str, Any]) -> np.ndarray:
    return reference_image(
        tiny_sd3, prompt=request["prompt"], seed=request["seed"], height=64, width=64,
        steps=request["num_inference_steps"], guidance=GUIDANCE,
    )  # fmt: skip


def assert_alone(tiny_sd3: Path, image: np.ndarray, request: dict[str, Any]) -> None:
    assert image.std() > 5
    diff = np.abs(image.astype(int) - alone(tiny_sd3, request).astype(int)).max()
    assert diff <= 1, (request["prompt"], diff)


def ran(held: str) -> list[str]:
    return held.split()


def step_until(hold: Hold, server: ServerProcess, held: str, done: Any, limit: int = 200) -> list[list[str]]:
    """Step the loop until ``done(ids the step ran)``: the steps seen, the last one included."""
    seen = [ran(held)]
    while not done(seen[-1]):
        assert len(seen) < limit, seen[-5:]
        seen.append(ran(hold.next(alive=server.alive)))
    return seen


def test_a_short_request_beside_a_long_one_finishes_first_with_its_own_image(
    server: ServerProcess, tiny_sd3: Path
) -> None:
    long, short = body("a long one", 1, 40), body("a short one", 2, 4)
    with ThreadPoolExecutor(2) as pool, server.hold("dit.step") as hold:  # released before the pool waits
        long_answer = pool.submit(generate, server, long)
        first = ran(hold.wait(alive=server.alive))
        assert len(first) == 1
        short_answer = pool.submit(generate, server, short)
        together = step_until(hold, server, " ".join(first), lambda ids: len(ids) == 2)
        long_id = first[0]
        short_id = next(i for i in together[-1] if i != long_id)
        after = step_until(hold, server, hold.next(alive=server.alive), lambda ids: short_id not in ids)
        assert after[-1] == [long_id]  # the short one is done: the long one runs on
        short_image = short_answer.result(timeout=300)
        assert not long_answer.done()
        assert len(after) == 4  # its three steps after the one that admitted it, then the long one alone
    assert_alone(tiny_sd3, short_image, short)
    assert_alone(tiny_sd3, long_answer.result(timeout=300), long)


def preemptions(server: ServerProcess) -> float:
    text = http_client.get(server.base_url + "/metrics", timeout=30).text
    found = re.findall(r"^omni_diffusion_preemptions_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def test_a_better_priority_preempts_between_steps_and_the_preempted_one_resumes_unchanged(
    server: ServerProcess, tiny_sd3: Path
) -> None:
    low_a, low_b = body("low a", 3, 12, priority=5), body("low b", 4, 12, priority=5)
    high = body("high", 5, 4, priority=-1)
    before = preemptions(server)
    answers: dict[str, Future[np.ndarray]] = {}
    with ThreadPoolExecutor(3) as pool, server.hold("dit.step") as hold:
        answers["low a"] = pool.submit(generate, server, low_a)
        held = hold.wait(alive=server.alive)
        answers["low b"] = pool.submit(generate, server, low_b)
        both = step_until(hold, server, held, lambda ids: len(ids) == 2)[-1]  # the step budget is full
        answers["high"] = pool.submit(generate, server, high)
        seen = step_until(hold, server, hold.next(alive=server.alive), lambda ids: set(ids) - set(both))
        (high_id,) = seen[-1]  # it runs as if alone: both worse ones parked
        during = step_until(hold, server, high_id, lambda ids: high_id not in ids)
        assert during[:-1] == [[high_id]] * 4, during
        assert answers["high"].result(timeout=300) is not None
        assert not answers["low a"].done() and not answers["low b"].done()
        assert sorted(during[-1]) == sorted(both)  # both resumed at the step after the better one left
    for name, request in (("low a", low_a), ("low b", low_b), ("high", high)):
        assert_alone(tiny_sd3, answers[name].result(timeout=300), request)
    assert preemptions(server) - before == 8  # two requests left out of four steps


def test_requests_it_runs_whole_and_concurrent_ones_each_get_diffusers_image(
    server: ServerProcess, tiny_sd3: Path
) -> None:
    """A streamed request with previews runs as a whole request between the loop's steps: its completed
    image is the one the loop makes of it unstreamed."""
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300, max_retries=0)
    plain_request = body("a lighthouse at dusk", 7, 4)
    ask = {"prompt": plain_request["prompt"], "size": "64x64"}
    extra = {k: plain_request[k] for k in ("seed", "num_inference_steps", "guidance_scale", "priority")}
    plain = pixels(client.images.generate(**ask, extra_body=extra).data[0].b64_json)
    assert_alone(tiny_sd3, plain, plain_request)
    events = list(client.images.generate(**ask, stream=True, partial_images=2, extra_body=extra))
    assert assert_streamed(events, "image_generation", 2, plain) == []
    jobs = [body(f"thing {i}", 10 + i, 3 + i % 3) for i in range(5)]
    with ThreadPoolExecutor(5) as pool:
        images = list(pool.map(lambda job: generate(server, job), jobs))
    for job, image in zip(jobs, images, strict=True):
        assert_alone(tiny_sd3, image, job)
