"""The runtime core without engines or processes (the fast tier): the orchestrator, the replica pool,
replies awaited over a socket and stage payloads through a connector, including cancel and error paths.
Replicas are ``FakeStageClient``s (a ``StageCoreClientBase`` answering in this process)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from helpers import FakePlacement, FakeStageClient, ar_answer, dit_answer, fake_deployment
from vllm_omni_plugin.connectors.base import HANDLE_KEY, ConnectorError, InProcessConnector
from vllm_omni_plugin.families.glm_image.runner import GlmImageRequest
from vllm_omni_plugin.stage.async_omni import stages_start_side_by_side
from vllm_omni_plugin.stage.core_client import StageState
from vllm_omni_plugin.stage.core_types import (
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageLLMCoreRequest,
)
from vllm_omni_plugin.stage.errors import (
    QuarantinedError,
    RequestAbortedError,
    RetriesExhaustedError,
    StageDeadError,
    StageError,
    StageRequestError,
    StageStartError,
    WorkerLostError,
)
from vllm_omni_plugin.stage.factory import build_stages
from vllm_omni_plugin.stage.input_processor import InputError, InputProcessor, OmniCoreRequest, RequestBounds
from vllm_omni_plugin.stage.orchestrator import OmniRequest, OmniResult, Orchestrator
from vllm_omni_plugin.stage.payload import (
    collect_output,
    discard_output,
    externalize,
    internalize,
    release,
    send_request_through,
)
from vllm_omni_plugin.stage.pending_replies import PendingReplies
from vllm_omni_plugin.stage.replica_pool import StageReplicaPool
from vllm_omni_plugin.stage.serialization import StageMessageCodec


@pytest.fixture
def deployment(tmp_path: Path):
    return fake_deployment(tmp_path)


def runtime(deployment, answers: dict[int, Any] | None = None) -> tuple[Orchestrator, FakePlacement]:
    placement = FakePlacement(answers)
    pools = build_stages(deployment, {}, placement=placement)
    return Orchestrator(deployment, pools), placement


async def started(orchestrator: Orchestrator) -> Orchestrator:
    for pool in orchestrator.pools.values():
        await pool.start()
    return orchestrator


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


# --- the orchestrator -----------------------------------------------------------------------------------


def test_request_runs_through_both_stages_with_timings(deployment) -> None:
    async def main() -> OmniResult:
        orchestrator, _ = runtime(deployment)
        await started(orchestrator)
        return await orchestrator.generate(OmniRequest(prompt="abc", height=32, width=48))

    result = run(main())
    assert result.ok, result.error
    assert result.output.image.shape == (32, 48, 3)
    assert result.stage_outputs[0].token_ids == [ord("c"), ord("b"), ord("a")]
    for key in ("queue", "processor_0", "stage_0", "stage_0_ar", "processor_1", "stage_1", "stage_1_denoise"):
        assert key in result.timings, (key, result.timings)
    (ar,) = [iv for iv in result.intervals if iv.stage_id == 0]
    (dit,) = [iv for iv in result.intervals if iv.stage_id == 1]
    assert ar.end <= dit.start  # the DiT started after its source


@pytest.mark.parametrize(
    ("policies", "reached"), [({0: "priority"}, {0: -3, 1: 0}), ({1: "priority"}, {0: 0, 1: -3})]
)
def test_a_priority_reaches_the_stages_that_schedule_by_it_and_is_refused_where_none_does(
    tmp_path: Path, policies: dict[int, str], reached: dict[int, int]
) -> None:
    """An AR stage's ``scheduling_policy`` is vLLM's engine argument: its requests carry
    the priority to vLLM; a stage without it gets 0; with no stage scheduling by priority, a priority
    other than 0 is an input error naming the field."""
    deploy = "stages:\n" + "".join(
        f"  - stage_id: {sid}\n    scheduling_policy: {policy}\n" for sid, policy in policies.items()
    )
    deployment = fake_deployment(tmp_path, deploy)
    if 0 in policies:
        assert deployment.stage(0).engine_args["scheduling_policy"] == "priority"
    seen: dict[int, int] = {}

    def ar(request: StageLLMCoreRequest) -> Any:
        seen[0] = request.priority
        return ar_answer(request)

    def dit(request: StageDiffusionCoreRequest) -> Any:
        seen[1] = request.diffusion.priority
        return dit_answer(request)

    async def main() -> OmniResult:
        orchestrator, _ = runtime(deployment, {0: ar, 1: dit})
        return await (await started(orchestrator)).generate(OmniRequest(prompt="abc", priority=-3))

    result = run(main())
    assert result.ok, result.error
    assert seen == reached
    with pytest.raises(InputError, match="set scheduling_policy: priority on its stages") as refused:
        process(fake_deployment(tmp_path), OmniRequest(prompt="abc", priority=-3))
    assert refused.value.field == "priority"


def test_request_defaults_come_from_resolution(deployment) -> None:
    """The DiT stage's size defaults are the pipeline's, merged by resolution and applied by the input
    processor; none reaches the stage's worker."""
    assert deployment.stage(1).request_defaults == {"height": 64, "width": 64}
    assert "height" not in deployment.stage(1).diffusion_args

    async def main() -> OmniResult:
        orchestrator, _ = runtime(deployment)
        return await (await started(orchestrator)).generate(OmniRequest(prompt="abc"))

    assert run(main()).output.image.shape == (64, 64, 3)


# --- the input processor --------------------------------------------------------------------------------


def process(deployment: Any, request: OmniRequest, bounds: RequestBounds | None = None) -> OmniCoreRequest:
    return asyncio.run(InputProcessor(deployment).process(request, bounds))


def test_the_input_processor_finishes_a_request_once(deployment) -> None:
    """Unset fields get the deployment's defaults (the fake pipeline's 64x64; its model folder states
    none), a side given alone takes the other's default, an edit without a size its source's aspect on
    the grid (within the operator's bound), a text answer no size; the request comes out frozen."""
    core = process(deployment, OmniRequest(prompt="a fox", seed=3, num_inference_steps=2))
    assert (core.width, core.height, core.num_inference_steps, core.seed) == (64, 64, 2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(core, "height", 32)  # noqa: B010 - a frozen dataclass refuses it
    one_side = process(deployment, OmniRequest(prompt="a fox", width=32))
    assert (one_side.width, one_side.height) == (32, 64)
    edit = process(deployment, OmniRequest(prompt="a fox", images=[np.zeros((40, 100, 3), np.uint8)]))
    assert (edit.width, edit.height) == (96, 32)  # multiples of 16
    wide = OmniRequest(prompt="a fox", images=[np.zeros((64, 400, 3), np.uint8)])
    bounded = process(deployment, wide, RequestBounds(max_side=128))
    assert (bounded.width, bounded.height) == (128, 16)
    text = process(deployment, OmniRequest(prompt="hi", modality="text"))
    assert (text.width, text.height) == (None, None)


@pytest.mark.parametrize(
    ("sides", "field", "message"),
    [
        ({"width": 40, "height": 64}, "size", "width and height must be multiples of 16 and at least 16 pixels, got 40x64"),
        ({"height": 0}, "height", "height must be a multiple of 16 and at least 16 pixels, got 0"),
        ({"width": 4096}, "width", "width must be at most 2048 pixels on this server, got 4096"),
        ({"width": 4096, "height": 64}, "size", "width and height must be at most 2048 pixels on this server, got 4096x64"),
    ],
)  # fmt: skip
def test_the_input_processor_names_the_field_it_refuses(
    deployment, sides: dict[str, int], field: str, message: str
) -> None:
    with pytest.raises(InputError) as refused:
        process(deployment, OmniRequest(prompt="a fox", **sides), RequestBounds(max_side=2048))
    assert (refused.value.field, refused.value.message) == (field, message)


def test_a_runner_request_carries_the_request_s_fields(deployment) -> None:
    """One place copies the shared fields into a runner's request; the family adds its own (and sends its
    images its own way)."""
    given = OmniRequest(
        prompt="a 'sign'", seed=5, negative_prompt="x", partial_images=2, num_inference_steps=3
    )
    core = process(deployment, given)
    glm = core.runner_request(GlmImageRequest, prior_token_ids=[1])
    assert (glm.request_id, glm.prompt, glm.height, glm.width, glm.num_inference_steps) == (
        given.request_id, "a 'sign'", 64, 64, 3,
    )  # fmt: skip
    assert (glm.seed, glm.negative_prompt, glm.partial_images, glm.prior_token_ids, glm.images) == (
        5, "x", 2, [1], None,
    )  # fmt: skip


def test_an_offline_request_the_model_cannot_make_fails_before_any_stage(deployment) -> None:
    async def main() -> tuple[OmniResult, FakePlacement]:
        orchestrator, placement = runtime(deployment)
        await started(orchestrator)
        return await orchestrator.generate(OmniRequest(prompt="abc", width=40, height=64)), placement

    result, placement = run(main())
    assert isinstance(result.exception, StageRequestError) and result.error_stage == 0
    assert "multiples of 16" in (result.error or "")
    assert not any(c.served for clients in placement.clients.values() for c in clients)


def test_a_model_folder_without_its_components_states_no_defaults(tmp_path: Path) -> None:
    """Its model's own defaults are read from its components' configs; a folder that names none has none
    (the deploy config's apply; its stage's start says what is wrong)."""
    from vllm_omni_plugin.families.glm_image.runner import GlmImageRunner

    model = tmp_path / "glm"
    model.mkdir()
    (model / "model_index.json").write_text('{"_class_name": "GlmImagePipeline"}')
    with pytest.raises(ValueError, match="names no"):
        GlmImageRunner.model_defaults(str(model))


@pytest.mark.parametrize(
    ("failure", "message"),
    [
        (StageError("the DiT ran out of memory", stage_id=1), "the DiT ran out of memory"),
        (StageRequestError("height must be a multiple of 32", stage_id=1), "multiple of 32"),
        (RuntimeError("a bug"), "RuntimeError: a bug"),
    ],
)
def test_a_failing_stage_fails_its_request_and_aborts_it_everywhere(deployment, failure, message) -> None:
    def broken(request: Any) -> Any:
        raise failure

    async def main() -> tuple[OmniResult, FakePlacement]:
        orchestrator, placement = runtime(deployment, {1: broken})
        await started(orchestrator)
        return await orchestrator.generate(OmniRequest(prompt="abc", request_id="r1")), placement

    result, placement = run(main())
    assert not result.ok and message in (result.error or "")
    assert result.exception is failure
    assert result.error_stage == (1 if isinstance(failure, StageError) else None)
    assert all(c.aborted == ["r1"] for clients in placement.clients.values() for c in clients)


def test_a_processor_error_fails_only_its_request(deployment) -> None:
    async def main() -> list[OmniResult]:
        orchestrator, _ = runtime(deployment)
        await started(orchestrator)
        return list(
            await asyncio.gather(
                orchestrator.generate(OmniRequest(prompt="")), orchestrator.generate(OmniRequest(prompt="ok"))
            )
        )

    empty, fine = run(main())
    assert not empty.ok and empty.error == "ValueError: the prompt is empty"
    assert isinstance(empty.exception, ValueError)
    assert fine.ok, fine.error


def test_cancelling_a_request_aborts_it_in_every_stage(deployment) -> None:
    entered = asyncio.Event()

    async def stuck(request: StageDiffusionCoreRequest) -> Any:
        entered.set()
        await asyncio.Event().wait()

    async def main() -> FakePlacement:
        orchestrator, placement = runtime(deployment, {1: stuck})
        await started(orchestrator)
        task = asyncio.ensure_future(orchestrator.generate(OmniRequest(prompt="abc", request_id="gone")))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return placement

    placement = run(main())
    (ar,), (dit,) = placement.clients[0], placement.clients[1]
    assert dit.cancelled == ["gone"] and dit.inflight == set()
    assert ar.aborted == ["gone"] and dit.aborted == ["gone"]
    assert ar.served == ["gone"] and dit.served == []


def test_max_inflight_holds_requests_back_on_their_edge(tmp_path: Path) -> None:
    deployment = fake_deployment(tmp_path, "edges: [{from: 0, to: 1, max_inflight: 1}]\n")
    assert deployment.edge(0, 1).max_inflight == 1
    first_in, release_first = asyncio.Event(), asyncio.Event()
    entered: list[str] = []

    async def gated(request: StageDiffusionCoreRequest) -> StageDiffusionCoreOutput:
        entered.append(request.request_id)
        if request.request_id == "first":
            first_in.set()
            await release_first.wait()
        return dit_answer(request)

    async def main() -> tuple[list[OmniResult], list[str]]:
        orchestrator, placement = runtime(deployment, {1: gated})
        await started(orchestrator)
        first = asyncio.ensure_future(orchestrator.generate(OmniRequest(prompt="a", request_id="first")))
        await first_in.wait()
        second = asyncio.ensure_future(orchestrator.generate(OmniRequest(prompt="b", request_id="second")))
        (ar,) = placement.clients[0]
        while "second" not in ar.served:  # the second request's AR output is ready ...
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        held = list(entered)  # ... and waits for the edge while the first is in the DiT
        release_first.set()
        return list(await asyncio.gather(first, second)), held

    results, held = run(main())
    assert all(r.ok for r in results)
    assert held == ["first"] and entered == ["first", "second"]


def test_a_stage_without_a_pool_fails_clearly(deployment) -> None:
    async def main() -> OmniResult:
        placement = FakePlacement()
        pools = build_stages(deployment, {}, [0], placement=placement)
        orchestrator = await started(Orchestrator(deployment, pools))
        return await orchestrator.generate(OmniRequest(prompt="abc"))

    result = run(main())
    assert not result.ok and "stage 1 is not served by this deployment" in (result.error or "")


# --- replica deaths and retries --------------------------------------------------------------------------


class Deaths:
    """A fake DiT whose replica dies under the first ``deaths`` attempts of each request it names (and
    restarts within 50 ms), then answers; counts the attempts and what the stage-input processor built."""

    def __init__(self, deaths: dict[str, int], stage_id: int = 1) -> None:
        self.deaths = dict(deaths)
        self.stage_id = stage_id
        self.attempts: list[str] = []
        self.alone: list[bool] = []
        """Whether each attempt was asked to run alone."""
        self.client: FakeStageClient | None = None

    async def __call__(self, request: Any) -> Any:
        self.attempts.append(request.request_id)
        self.alone.append(getattr(request, "alone", False))
        if self.deaths.get(request.request_id, 0) > 0:
            self.deaths[request.request_id] -= 1
            assert self.client is not None
            error = self.client.replica_died("killed by the test")
            asyncio.get_running_loop().call_later(0.05, setattr, self.client, "state", StageState.READY)
            raise error
        await asyncio.sleep(0)
        return dit_answer(request) if self.stage_id == 1 else ar_answer(request)


def with_deaths(deployment: Any, answers: dict[int, Deaths]) -> tuple[Orchestrator, FakePlacement]:
    orchestrator, placement = runtime(deployment, dict(answers))
    for stage_id, answer in answers.items():
        (answer.client,) = placement.clients[stage_id]
    return orchestrator, placement


def test_a_replica_death_runs_the_stage_again_on_the_restarted_replica(deployment) -> None:
    dying = Deaths({"r1": 1})

    async def main() -> tuple[list[OmniResult], Orchestrator, FakePlacement]:
        orchestrator, placement = with_deaths(deployment, {1: dying})
        await started(orchestrator)
        results = await asyncio.gather(
            orchestrator.generate(OmniRequest(prompt="abc", request_id="r1")),
            orchestrator.generate(OmniRequest(prompt="xyz", request_id="r2")),
        )
        return list(results), orchestrator, placement

    (r1, r2), orchestrator, placement = run(main())
    assert r1.ok and r2.ok, (r1.error, r2.error)
    assert r1.output.image.shape == (64, 64, 3)
    assert r1.deaths == ["stage 1 (dit) replica 0 died (killed by the test) while serving this request"]
    assert r2.deaths == []
    assert dying.attempts.count("r1") == 2 and dying.attempts.count("r2") == 1
    (ar,), (dit,) = placement.clients[0], placement.clients[1]
    assert ar.served == ["r1", "r2"]  # the AR stage ran once: the DiT ran again from its held input
    assert dit.aborted == ["r1"]  # what the abandoned attempt left was aborted before the retry
    assert dit.deaths == 1 and orchestrator.retries == {1: 1} and not orchestrator.exhausted


def test_a_request_that_kills_its_stage_every_time_is_quarantined_after_its_budget(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After its first death it runs alone; dying alone too once its budget is spent, it is failed as
    the culprit (500, not the 503 a client would retry)."""
    deployment = fake_deployment(tmp_path, "max_retries: 2\n")
    dying = Deaths({"poison": 100})

    async def main() -> tuple[OmniResult, OmniResult, Orchestrator]:
        orchestrator, _ = with_deaths(deployment, {1: dying})
        await started(orchestrator)
        poison, fine = await asyncio.gather(
            orchestrator.generate(OmniRequest(prompt="abc", request_id="poison")),
            orchestrator.generate(OmniRequest(prompt="abc", request_id="fine")),
        )
        return poison, fine, orchestrator

    poison, fine, orchestrator = run(main())
    assert fine.ok, fine.error
    assert not poison.ok and isinstance(poison.exception, QuarantinedError)
    assert poison.exception.http_status == 500 and poison.error_stage == 1
    assert "alone" in poison.error and "3 deaths, max_retries 2" in poison.error
    assert dying.attempts.count("poison") == 3 and len(poison.deaths) == 3
    poison_alone = [a for r, a in zip(dying.attempts, dying.alone, strict=True) if r == "poison"]
    assert poison_alone == [False, True, True]
    assert (
        orchestrator.retries == {1: 2} and orchestrator.quarantined == {1: 1} and not orchestrator.exhausted
    )
    (line,) = [r for r in caplog.records if "quarantined after" in r.getMessage()]
    assert "request poison" in line.getMessage() and line.getMessage().count("killed by the test") == 3


class BatchingDit:
    """A fake DiT replica that batches: what it holds when ``go`` is set runs as one batch; requests
    asked to run alone run one at a time. A batch (or a lone run) holding ``poison`` kills the replica:
    what ran dies ``running``, what waited behind a lone run dies ``queued`` (as the diffusion client
    tells them apart)."""

    def __init__(self, poison: str) -> None:
        self.poison = poison
        self.go = asyncio.Event()
        self.batched: list[str] = []
        self.lone = asyncio.Lock()
        self.waiting: dict[str, asyncio.Future[Any]] = {}
        self.runs: list[list[str]] = []
        self.batch_death: StageDeadError | None = None
        self.client: FakeStageClient | None = None

    def kill(self, running: list[str]) -> StageDeadError:
        assert self.client is not None
        error = self.client.replica_died("killed by its poison")
        asyncio.get_running_loop().call_later(0.01, setattr, self.client, "state", StageState.READY)
        for request_id, future in self.waiting.items():
            if request_id not in running and not future.done():
                future.set_exception(
                    StageDeadError(f"{error} (queued)", stage_id=1, request_id=request_id, where="queued")
                )
        return error

    async def __call__(self, request: Any) -> Any:
        rid = request.request_id
        if not request.alone:
            self.batched.append(rid)
            await self.go.wait()
            batch = list(self.batched)
            if rid == batch[0]:
                self.runs.append(batch)
                if self.poison in batch:
                    self.batch_death = self.kill(batch)
            if self.batch_death is not None:
                raise self.batch_death
            return dit_answer(request)
        queued = asyncio.get_running_loop().create_future()
        self.waiting[rid] = queued
        try:
            async with self.lone:
                if queued.done():  # the replica died while this one waited behind a lone run
                    queued.result()
                self.runs.append([rid])
                await asyncio.sleep(0)
                if rid == self.poison:
                    raise self.kill([rid])
                return dit_answer(request)
        finally:
            self.waiting.pop(rid, None)


def test_a_poison_request_is_quarantined_and_its_batch_neighbours_get_their_images(deployment) -> None:
    """The poison kills its batch; every request of that batch runs again alone; the poison kills its
    lone run too and is failed, the others (among them those queued behind it) are served, and the
    deaths they only waited through cost them no retry."""
    dit = BatchingDit("poison")
    ids = ["n1", "n2", "poison", "n3", "n4"]

    async def main() -> tuple[list[OmniResult], Orchestrator]:
        orchestrator, placement = runtime(deployment, {1: dit})
        (dit.client,) = placement.clients[1]
        await started(orchestrator)
        work = asyncio.gather(*(orchestrator.generate(OmniRequest(prompt=i, request_id=i)) for i in ids))
        while len(dit.batched) < len(ids):
            await asyncio.sleep(0.01)
        dit.go.set()
        return list(await work), orchestrator

    results, orchestrator = run(main())
    by_id = dict(zip(ids, results, strict=True))
    poison = by_id.pop("poison")
    assert isinstance(poison.exception, QuarantinedError) and poison.exception.http_status == 500
    assert len(poison.deaths) == 2
    for request_id, result in by_id.items():
        assert result.ok, (request_id, result.error)
        assert len(result.deaths) in (1, 2)  # its batch's, and maybe the poison's lone run it queued behind
        assert "queued" in "".join(result.deaths[1:]) or len(result.deaths) == 1
    assert dit.runs[0] == ids  # one batch first, then each request alone
    assert sorted(r[0] for r in dit.runs[1:] if r[0] in by_id) == sorted(by_id)
    assert all(len(run) == 1 for run in dit.runs[1:])
    assert orchestrator.quarantined == {1: 1} and not orchestrator.exhausted
    assert dit.client is not None and dit.client.deaths == 2


@pytest.mark.parametrize(("queued_deaths", "ok"), [(3, True), (4, False)])
def test_deaths_a_request_only_waited_through_cost_no_retry(
    tmp_path: Path, queued_deaths: int, ok: bool
) -> None:
    """With ``max_retries: 0`` a request still runs again after a death it waited through in the queue,
    up to QUEUED_DEATHS of them; the next one counts as any other."""
    deployment = fake_deployment(tmp_path, "max_retries: 0\n")
    left = {"n": queued_deaths}

    async def dies_behind_others(request: Any) -> Any:
        if left["n"] > 0:
            left["n"] -= 1
            raise StageDeadError("the replica died under another", stage_id=1, where="queued")
        return dit_answer(request)

    async def main() -> tuple[OmniResult, Orchestrator]:
        orchestrator, _ = runtime(deployment, {1: dies_behind_others})
        await started(orchestrator)
        return await orchestrator.generate(OmniRequest(prompt="abc")), orchestrator

    result, orchestrator = run(main())
    assert result.ok is ok, result.error
    assert len(result.deaths) == queued_deaths
    if not ok:
        assert isinstance(result.exception, RetriesExhaustedError) and orchestrator.exhausted == {1: 1}


@pytest.mark.parametrize(("max_retries", "ok"), [(0, False), (1, False), (2, True)])
def test_the_budget_is_per_request_across_stages(tmp_path: Path, max_retries: int, ok: bool) -> None:
    deployment = fake_deployment(tmp_path, f"max_retries: {max_retries}\n")
    ar, dit = Deaths({"r": 1}, stage_id=0), Deaths({"r": 1}, stage_id=1)

    async def main() -> OmniResult:
        orchestrator, _ = with_deaths(deployment, {0: ar, 1: dit})
        await started(orchestrator)
        return await orchestrator.generate(OmniRequest(prompt="abc", request_id="r"))

    result = run(main())
    assert result.ok is ok, result.error
    assert len(result.deaths) == min(max_retries + 1, 2)
    if not ok:
        assert isinstance(result.exception, RetriesExhaustedError)


def test_a_lost_headless_worker_fails_its_requests_at_once(deployment) -> None:
    """A worker on another host comes back only when someone starts one: no retry waits for it."""
    attempts: list[str] = []

    def lost(request: Any) -> Any:
        attempts.append(request.request_id)
        raise WorkerLostError(
            "stage 1 (dit) worker went silent; waiting for the worker to rejoin", stage_id=1
        )

    async def main() -> tuple[OmniResult, Orchestrator]:
        orchestrator, _ = runtime(deployment, {1: lost})
        await started(orchestrator)
        return await orchestrator.generate(OmniRequest(prompt="abc")), orchestrator

    result, orchestrator = run(main())
    assert isinstance(result.exception, WorkerLostError) and result.exception.http_status == 503
    assert len(attempts) == 1 and result.deaths == [] and not orchestrator.retries


def test_a_dead_stage_that_does_not_come_back_fails_within_the_budget(deployment) -> None:
    async def dies_for_good(request: Any) -> Any:
        (client,) = placement.clients[1]
        client.restart_on_death = False
        raise client.replica_died("exit code -9")

    async def main() -> OmniResult:
        nonlocal placement
        orchestrator, placement = runtime(deployment, {1: dies_for_good})
        await started(orchestrator)
        return await orchestrator.generate(OmniRequest(prompt="abc"))

    placement: FakePlacement
    result = run(main())
    assert not result.ok and isinstance(result.exception, RetriesExhaustedError)
    assert "no healthy replica" in result.error and len(result.deaths) == 2


# --- the replica pool -----------------------------------------------------------------------------------


def clients(n: int) -> list[FakeStageClient]:
    return [FakeStageClient(1, i, "dit", dit_answer, pid=100 + i) for i in range(n)]


def test_pool_routes_to_the_least_loaded_healthy_replica() -> None:
    a, b, c = clients(3)
    pool = StageReplicaPool(1, "dit", [a, b, c])

    async def main() -> None:
        await pool.start()
        a.inflight.update({"x", "y"})
        b.inflight.add("z")
        c.state = StageState.RESTARTING
        assert pool.pick() is b
        b.inflight.update({"p", "q"})
        assert pool.pick() is a  # fewer in flight; ties go to the lower replica id
        a.state = b.state = StageState.DEAD
        with pytest.raises(StageDeadError, match=r"no healthy replica .*replica 2: restarting"):
            pool.pick()

    run(main())


def test_pool_waits_for_a_restarting_replica_and_gives_up_without_one() -> None:
    (a,) = clients(1)
    pool = StageReplicaPool(1, "dit", [a])

    async def main() -> None:
        await pool.start()
        a.state = StageState.RESTARTING

        async def back() -> None:
            await asyncio.sleep(0.2)
            a.state = StageState.READY

        restarted = asyncio.ensure_future(back())
        assert await pool.acquire(timeout=10) is a
        await restarted
        a.state = StageState.DEAD
        with pytest.raises(StageDeadError):
            await pool.acquire(timeout=10)  # nothing is recovering: no wait
        a.state = StageState.STARTING
        with pytest.raises(StageDeadError):
            await pool.acquire(timeout=0.1)  # recovering, but not in time

    run(main())


def test_pool_start_failure_stops_every_replica() -> None:
    a, b = clients(2)
    b.start_error = StageStartError("no model files", stage_id=1)
    pool = StageReplicaPool(1, "dit", [a, b])
    with pytest.raises(StageStartError, match="no model files"):
        run(pool.start())
    assert a.shutdowns == b.shutdowns == 1 and a.state == StageState.STOPPED


def test_pool_health_abort_and_restart_policy() -> None:
    a, b = clients(2)
    pool = StageReplicaPool(1, "dit", [a, b])
    run(pool.start())
    a.inflight.add("r")
    b.state = StageState.RESTARTING
    assert pool.health() == {
        "stage_id": 1,
        "name": "dit",
        "healthy": True,
        "replicas": [
            {"replica_id": 0, "state": "ready", "inflight": 1, "restarts": 0, "pid": 100},
            {"replica_id": 1, "state": "restarting", "inflight": 0, "restarts": 0, "pid": None},
        ],
    }
    assert pool.queue_depth == 1 and not pool.awaits_worker
    run(pool.abort(["r"]))
    assert a.aborted == b.aborted == ["r"]
    assert a.restart_on_death and b.restart_on_death
    pool.stop_restarting()
    assert not a.restart_on_death and not b.restart_on_death
    with pytest.raises(ValueError, match="no replicas"):
        StageReplicaPool(1, "dit", [])


# --- replies awaited over a socket ----------------------------------------------------------------------


def test_pending_replies_deliver_fail_and_abort_on_cancel() -> None:
    client = FakeStageClient(1, 0, "dit", dit_answer)
    pending = PendingReplies(client)
    sent: list[str] = []

    async def send(request_id: str) -> None:
        sent.append(request_id)

    async def main() -> None:
        delivered = asyncio.ensure_future(pending.wait("a", send("a")))
        await asyncio.sleep(0)
        assert client.inflight == {"a"} and len(pending) == 1 and sent == ["a"]
        assert pending.resolve("a", "reply")
        assert await delivered == "reply" and client.inflight == set() and len(pending) == 0
        assert not pending.resolve("a", "late")  # nobody waits any more

        aborted = asyncio.ensure_future(pending.wait("b", send("b")))
        await asyncio.sleep(0)
        pending.fail(["b"])
        with pytest.raises(RequestAbortedError):
            await aborted

        waits = [asyncio.ensure_future(pending.wait(r, send(r))) for r in ("c", "d")]
        await asyncio.sleep(0)
        pending.fail_all(StageDeadError("the stage died", stage_id=1))
        for wait in waits:
            with pytest.raises(StageDeadError, match="died"):
                await wait

        cancelled = asyncio.ensure_future(pending.wait("e", send("e")))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert client.aborted == ["e"] and client.inflight == set() and len(pending) == 0

    run(main())


def test_a_send_that_fails_after_a_death_ended_its_wait_leaves_no_unretrieved_error() -> None:
    """The process dies while a request is being sent: the death ends every wait (``fail_all``) and the
    send fails too. The wait raises the send's error; the death's, set on its future, is retrieved, so
    asyncio logs no "Future exception was never retrieved" when the future goes."""
    import gc

    client = FakeStageClient(1, 0, "dit", dit_answer)
    pending = PendingReplies(client)
    unretrieved: list[dict[str, Any]] = []

    async def send_to_a_dead_process() -> None:
        pending.fail_all(StageDeadError("the stage died", stage_id=1))
        raise StageDeadError("not connected (its process died)", stage_id=1, where="unsent")

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: unretrieved.append(context))
        with pytest.raises(StageDeadError, match="not connected"):
            await pending.wait("a", send_to_a_dead_process())
        gc.collect()
        await asyncio.sleep(0)

    run(main())
    assert not unretrieved and client.inflight == set() and len(pending) == 0


# --- payloads through a connector -----------------------------------------------------------------------


class Holder(msgspec.Struct):
    big: Any
    small: Any
    nested: Any


def test_externalize_and_internalize_round_trip() -> None:
    connector = InProcessConnector("edge")
    value = Holder(
        big=torch.arange(64, dtype=torch.float32),
        small=torch.ones(2),
        nested={"ids": [torch.arange(32, dtype=torch.int64)], "text": "kept"},
    )
    wired = externalize(value, connector, min_bytes=100)
    assert set(wired.big) == {HANDLE_KEY} and torch.equal(wired.small, torch.ones(2))  # small ones stay
    assert set(wired.nested["ids"][0]) == {HANDLE_KEY} and wired.nested["text"] == "kept"
    assert connector.health().outstanding == 2
    codec = StageMessageCodec(Holder)  # what a stage process receives
    back = internalize(codec.decode(codec.encode(wired)), connector)
    assert torch.equal(back.big, value.big) and torch.equal(back.small, value.small)
    assert torch.equal(back.nested["ids"][0], value.nested["ids"][0])
    assert connector.health().outstanding == 0
    with pytest.raises(ConnectorError, match="no value for handle"):
        internalize(wired, connector)  # every value is read at most once


def test_release_frees_what_will_never_be_read() -> None:
    connector = InProcessConnector("edge")
    wired = externalize([torch.zeros(8), {"x": torch.ones(8)}], connector)
    assert connector.health().outstanding == 2
    release(wired, connector)
    assert connector.health().outstanding == 0


def test_requests_and_outputs_through_a_connector() -> None:
    connector = InProcessConnector("edge")
    diffusion = GlmImageRequest(request_id="r", prompt="p", prior_token_ids=torch.arange(16))
    request = StageDiffusionCoreRequest(request_id="r", stage_id=1, diffusion=diffusion)
    assert send_request_through(request, None) == (request, 0.0)
    sent, seconds = send_request_through(request, connector)
    assert seconds >= 0 and set(sent.diffusion.prior_token_ids) == {HANDLE_KEY}

    image = torch.full((4, 4, 3), 9, dtype=torch.uint8)
    output = StageDiffusionCoreOutput(
        request_id="r", stage_id=1, image_handle=msgspec.to_builtins(connector.put(image))
    )
    collect_output(output, connector)
    assert isinstance(output.image, np.ndarray) and int(output.image.max()) == 9
    assert output.image_handle is None and "transfer_out" in output.timings

    unread = StageDiffusionCoreOutput(
        request_id="s", stage_id=1, image_handle=msgspec.to_builtins(connector.put(image))
    )
    before = connector.health().outstanding
    discard_output(unread, connector)
    discard_output(None, connector)  # a reply without an output: nothing to free
    assert connector.health().outstanding == before - 1


def test_a_stage_request_error_is_a_client_error() -> None:
    """Stage errors carry the HTTP status a server answers with."""
    assert StageRequestError("too small").http_status == 400
    assert StageError("bug").http_status == 500
    assert StageDeadError("died").http_status == StageStartError("x").http_status == 503
    assert RequestAbortedError("gone").http_status == 503


def test_stages_start_side_by_side_unless_two_share_a_gpu(tmp_path: Path) -> None:
    """vLLM sizes an engine's KV cache from the GPU memory it measures while it loads, so stages whose
    replicas share a GPU (or do not say which) start one after the other; on CPU they start together."""
    deployment = fake_deployment(tmp_path)
    assert stages_start_side_by_side(deployment)
    deployment.platform = "cuda"
    assert not stages_start_side_by_side(deployment)  # no stage names its devices
    for stage, devices in zip(deployment.stages, ("0", "1,2"), strict=True):
        for replica in stage.replicas:
            replica.devices = devices
    assert stages_start_side_by_side(deployment)
    deployment.stages[1].replicas[0].devices = "2,0"
    assert not stages_start_side_by_side(deployment)
