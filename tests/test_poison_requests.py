"""No request can take others down with it: a request whose batch killed its diffusion stage runs again
alone, one that kills its stage alone is failed (quarantined) and never run with others again, and the
requests that only waited in a dying process's queue run again without spending a retry.

The fast tests check the pieces (which requests start together, which a dead process was running); the
server test runs a poison request (the test-only fault hook: a seed that makes the diffusion process
SIGKILL itself whenever a batch holds it) among normal ones through a real ``vllm serve --omni``."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import serve_model
from vllm_omni_plugin.stage.core_types import StageDiffusionCoreRequest
from vllm_omni_plugin.stage.diffusion_core_client import StageDiffusionCoreClient
from vllm_omni_plugin.stage.diffusion_core_proc import StageDiffusionProcConfig
from vllm_omni_plugin.stage.diffusion_loop import DiffusionInbox, batch_prefix
from vllm_omni_plugin.stage.errors import StageDeadError
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.server import ServerProcess
from vllm_omni_testkit.holds import FAULT_SEED_ENV

# --- which requests start together ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alone", "limit", "count"),
    [
        ([], 4, 0),
        ([False] * 6, 4, 4),
        ([False, False], 4, 2),
        ([True, False, False], 4, 1),
        ([False, False, True, False], 4, 2),
        ([True, True], 4, 1),
        ([False], 0, 0),
    ],
)
def test_batch_prefix(alone: list[bool], limit: int, count: int) -> None:
    assert batch_prefix(alone, limit) == count


def message(request_id: str, alone: bool = False) -> StageDiffusionCoreRequest:
    return StageDiffusionCoreRequest(request_id=request_id, stage_id=1, diffusion={}, alone=alone)


def test_whole_request_batches_take_a_lone_request_by_itself() -> None:
    inbox = DiffusionInbox()
    for request in (message("a"), message("b"), message("p", alone=True), message("c")):
        inbox.add(request)
    assert [r.request_id for r in inbox.take(8)] == ["a", "b"]
    inbox.finish()
    assert [r.request_id for r in inbox.take(8)] == ["p"] and inbox.alone_running
    inbox.finish()
    assert [r.request_id for r in inbox.take(8)] == ["c"] and not inbox.alone_running


def test_step_batching_starts_a_lone_request_once_nothing_runs_and_nothing_beside_it() -> None:
    inbox = DiffusionInbox()
    inbox.add(message("a"))
    assert [r.request_id for r in inbox.take_rows(4)] == ["a"]
    inbox.add(message("p", alone=True))
    assert inbox.take_rows(3) == []  # "a" still runs
    inbox.done(["a"])
    assert [r.request_id for r in inbox.take_rows(4)] == ["p"]
    inbox.add(message("b"))
    assert inbox.take_rows(3) == []  # nothing starts beside a lone run
    inbox.done(["p"])
    assert [r.request_id for r in inbox.take_rows(4)] == ["b"]
    # normal requests queued ahead of a lone one start without waiting for more to join them
    inbox.done(["b"])
    inbox.add(message("c"))
    inbox.add(message("q", alone=True))
    inbox.add(message("d"))
    assert [r.request_id for r in inbox.take_rows(4, wait_s=60)] == ["c"]


# --- which requests a dead process was running ----------------------------------------------------


def places_at_death(waiting: list[tuple[str, bool]], max_batch_size: int) -> dict[str, str]:
    """Where a diffusion client says each of its waiting requests (id, runs alone) was when its process
    died."""

    async def main() -> dict[str, str]:
        config = StageDiffusionProcConfig(
            stage_id=1, replica_id=0, input_address="", output_address="",
            diffusion_args={"max_batch_size": max_batch_size},
        )  # fmt: skip
        client = StageDiffusionCoreClient(config)

        async def sent() -> None:
            return None

        waits = {}
        for request_id, alone in waiting:
            if alone:
                client._alone.add(request_id)
            waits[request_id] = asyncio.ensure_future(client._pending.wait(request_id, sent()))
        await asyncio.sleep(0)
        death = StageDeadError("stage 1 (dit) replica 0 died (exit code -9) while serving", stage_id=1)
        client._pending.fail_all(death, errors=client._queued_at_death(death))
        places = {}
        for request_id, wait in waits.items():
            with pytest.raises(StageDeadError) as caught:
                await wait
            places[request_id] = caught.value.where
            if caught.value.where == "queued":
                assert "waited in its queue" in str(caught.value)
        return places

    return asyncio.run(main())


def test_the_client_tells_the_requests_a_dead_process_ran_from_those_that_waited() -> None:
    """The process takes batches in the order it got them (``batch_prefix``): of what it had not answered,
    the first batch ran, the rest waited (and cannot have killed it)."""
    five = [("a", False), ("b", False), ("c", False), ("d", False), ("e", True)]
    assert places_at_death(five, 3) == {
        "a": "running", "b": "running", "c": "running", "d": "queued", "e": "queued"
    }  # fmt: skip
    assert places_at_death([("p", True), ("f", False), ("g", False)], 8) == {
        "p": "running", "f": "queued", "g": "queued"
    }  # fmt: skip
    assert places_at_death([("f", False), ("p", True)], 8) == {"f": "running", "p": "queued"}


# --- a poison request served ------------------------------------------------------------------------

POISON_SEED = 6_660_666
DEPLOY = """
pipeline: diffusion
stages:
  - stage_id: 0
    max_batch_size: 8
    num_inference_steps: 2
    height: 64
    width: 64
"""


@pytest.fixture(scope="module")
def server(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("poison")
    (directory / "deploy.yaml").write_text(DEPLOY)
    env = {FAULT_SEED_ENV: str(POISON_SEED)}
    yield from serve_model(tiny_sd3, directory / "deploy.yaml", directory, env=env)


def generate(seed: int) -> dict[str, Any]:
    return {"prompt": f"a lighthouse at dusk {seed}", "seed": seed, "size": "64x64"}


@pytest.mark.server
def test_a_poison_request_among_normal_ones_is_failed_after_one_lone_run(server: ServerProcess) -> None:
    """A blocker holds the DiT while the poison and four normal requests queue behind it; released, they
    form one batch, which the poison kills. Each then runs alone: the poison kills its lone run too and
    gets 500 naming why; the four get their images; every request is answered."""
    deaths_before = server.metric("omni_stage_replica_deaths_total", stage="0", name="diffusion")

    async def main() -> tuple[httpx.Response, list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
            post = lambda seed: client.post("/v1/images/generations", json=generate(seed))  # noqa: E731
            with server.hold("dit.step") as hold:
                blocker = asyncio.ensure_future(post(1))
                await asyncio.to_thread(hold.wait, alive=server.alive)
                poison = asyncio.ensure_future(post(POISON_SEED))
                normal = [asyncio.ensure_future(post(seed)) for seed in (2, 3, 4, 5)]
                while server.metric("omni_stage_queue_depth", stage="0", name="diffusion") < 6:
                    await asyncio.sleep(0.05)
            return await poison, list(await asyncio.gather(*normal)), await blocker

    poison, normal, blocker = asyncio.run(main())
    assert blocker.status_code == 200, blocker.text
    for response in normal:
        assert response.status_code == 200, response.text
    assert poison.status_code == 500, poison.text
    assert "alone" in poison.json()["error"]["message"]
    assert server.metric("omni_stage_quarantined_requests_total", stage="0", name="diffusion") == 1
    assert server.metric("omni_stage_replica_deaths_total", stage="0", name="diffusion") == deaths_before + 2
    assert server.metric("omni_stage_retries_exhausted_total", stage="0", name="diffusion") == 0
    log = server.log_text()
    assert "Traceback" not in log
    assert re.search(r"request [0-9a-f]{32}: quarantined after 2 replica death\(s\)", log)
    after = http_client.post(server.base_url + "/v1/images/generations", json=generate(7), timeout=300)
    assert after.status_code == 200, after.text
