"""``Orchestrator``: runs each request through the resolved pipeline graph.

Every stage of a request is an asyncio task that waits for its source stages, calls the stage-input
processor the pipeline names (entry stages build their input from the user's request), and submits to
that stage's replica pool. Requests are independent tasks, so stages overlap: while the DiT denoises
request n, the AR engine decodes request n+1, and each stage batches what it has. An edge with
``max_inflight`` lets that many requests into its consuming stage at once; the others wait with their
source's output. Cancelling a request aborts it in every stage. Per-request timings record queue, each
stage, the processors and transfers, with absolute intervals so overlap can be checked.

A stage replica that dies fails the requests it was serving with ``StageDeadError``. Each such request
runs that stage again, from the stage's input (its sources' outputs, which the orchestrator holds; a
source output made of read-once connector handles, BAGEL's contexts, is made again by running its stage)
on a live or restarted replica, as long as its budget of ``max_retries`` lasts (one budget per request, all
stages together); then it fails with ``RetriesExhaustedError`` (HTTP 503), logged with the deaths it saw.
A request's output reaches its client only after every stage has finished, so an interrupted request has
delivered nothing, and every request is seeded and free of side effects: running it again gives what it
would have given.

No request takes others down twice. After a death it may have caused (it was in the batch the replica
ran), a request runs its diffusion stage again *alone* (``StageDiffusionCoreRequest.alone``: a batch of
its own, nothing beside it), so the batch's innocent requests are served and the culprit dies alone; a
request whose replica dies while it runs alone, its budget spent, is failed as the culprit
(``QuarantinedError``, HTTP 500) instead of running again. A death a request only waited through in the
replica's queue (its client knows: ``StageDeadError.where``) costs it no retry, up to ``QUEUED_DEATHS``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_omni_plugin.config.resolved import ResolvedDeployment
from vllm_omni_plugin.connectors.base import OmniConnector
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.core_types import StageCoreOutput, StageDiffusionCoreRequest, StageLLMCoreRequest
from vllm_omni_plugin.stage.errors import (
    QuarantinedError,
    RequestAbortedError,
    RetriesExhaustedError,
    StageDeadError,
    StageError,
    StageRequestError,
)
from vllm_omni_plugin.stage.input_processor import InputError, InputProcessor, OmniCoreRequest, OmniRequest
from vllm_omni_plugin.stage.input_work import input_work
from vllm_omni_plugin.stage.payload import carries_handles, release
from vllm_omni_plugin.stage.replica_pool import StageReplicaPool
from vllm_omni_plugin.stage.request_events import listen

logger = get_logger(__name__)


@dataclass
class StageInterval:
    stage_id: int
    start: float
    end: float


@dataclass
class OmniResult:
    request_id: str
    output: Any = None
    """The final stage's output (GLM-Image: a uint8 HxWx3 image array)."""
    error: str | None = None
    error_stage: int | None = None
    exception: BaseException | None = field(default=None, repr=False)
    """What failed the request (lets servers tell a dead stage or a bad request from a bug)."""
    timings: dict[str, float] = field(default_factory=dict)
    intervals: list[StageInterval] = field(default_factory=list)
    stage_outputs: dict[int, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    """What the pipeline's processors recorded for the client (e.g. BAGEL's ``think_text``)."""
    deaths: list[str] = field(default_factory=list)
    """The replica deaths that interrupted this request (each cost one retry)."""

    @property
    def ok(self) -> bool:
        return self.error is None


QUEUED_DEATHS = 3
"""How many replica deaths a request may see while it only waited in the replica's queue (which cost it
no retry: it cannot have caused them) before it fails all the same: a stage that keeps dying under other
requests does not keep this one waiting forever."""


@dataclass
class RetryBudget:
    """How often one request may run a stage again after a replica death (all its stages together)."""

    request_id: str
    max_retries: int
    deaths: list[str]
    queued_deaths: int = 0

    def spend(self, death: StageDeadError) -> bool:
        """Count ``death``; whether a retry is left (deaths the request only waited through count apart,
        up to ``QUEUED_DEATHS``)."""
        self.deaths.append(str(death))
        if death.where == "queued" and self.queued_deaths < QUEUED_DEATHS:
            self.queued_deaths += 1
            return True
        return len(self.deaths) - self.queued_deaths <= self.max_retries

    def exhausted(self, stage_id: int, death: StageDeadError) -> RetriesExhaustedError:
        logger.error(
            "request %s: giving up after %d replica death(s) (max_retries %d): %s",
            self.request_id,
            len(self.deaths),
            self.max_retries,
            " | ".join(self.deaths),
        )
        return RetriesExhaustedError(
            f"stage replicas died {len(self.deaths)} time(s) while serving this request, more than its "
            f"max_retries ({self.max_retries}) allows; last: {death}",
            stage_id=stage_id,
            request_id=self.request_id,
        )

    def quarantined(self, stage_id: int) -> QuarantinedError:
        logger.error(
            "request %s: quarantined after %d replica death(s), the last while it ran alone (max_retries "
            "%d): %s",
            self.request_id,
            len(self.deaths),
            self.max_retries,
            " | ".join(self.deaths),
        )
        return QuarantinedError(
            f"stage {stage_id}'s process died while running this request alone, after the batch it ran in "
            f"had died too ({len(self.deaths)} deaths, max_retries {self.max_retries}); it is not run "
            "again, so that it cannot take other requests down (the server log names it)",
            stage_id=stage_id,
            request_id=self.request_id,
        )


@dataclass
class ProcessorContext:
    """What a stage-input processor may use besides the outputs of its sources."""

    model: str
    deployment: ResolvedDeployment
    stage_id: int
    request: OmniCoreRequest
    notes: dict[str, Any] = field(default_factory=dict)
    """Shared by every processor call of one request and returned with its result (``OmniResult.notes``)."""


class Orchestrator:
    def __init__(
        self,
        deployment: ResolvedDeployment,
        pools: dict[int, StageReplicaPool],
        connectors: dict[str, OmniConnector] | None = None,
        inputs: InputProcessor | None = None,
    ) -> None:
        self.deployment = deployment
        self.pools = pools
        self.inputs = inputs or InputProcessor(deployment)
        """What completes a request that arrives as parsed (the offline API's), before its first stage."""
        self.connectors = connectors or {}
        """The deployment's connectors (this process's objects), to free payloads nobody will read."""
        self.stages = {s.stage_id: s for s in deployment.stages}
        self.processors = {
            s.stage_id: import_object(s.input_processor) for s in deployment.stages if s.input_processor
        }
        self.continuations = {
            s.stage_id: import_object(s.continuation) for s in deployment.stages if s.continuation
        }
        """Stages that may work on a request in more than one round (``f(output, context)`` returns the
        next round's request, or None when the stage is done)."""
        self.final_stage = next(s.stage_id for s in deployment.stages if s.final_output)
        self.edge_limits = {
            (e.from_stage, e.to): asyncio.Semaphore(e.max_inflight)
            for e in deployment.edges
            if isinstance(e.to, int) and e.max_inflight is not None
        }
        """Edges with ``max_inflight``: how many requests may be in their consuming stage at once."""
        self.retries: collections.Counter[int] = collections.Counter()
        """Stage id -> runs again after a replica death."""
        self.exhausted: collections.Counter[int] = collections.Counter()
        """Stage id -> requests that failed there because their retry budget was spent."""
        self.quarantined: collections.Counter[int] = collections.Counter()
        """Stage id -> requests failed there because its replica died while running them alone."""

    async def generate(self, request: OmniRequest | OmniCoreRequest) -> OmniResult:
        """Run one request through every stage (a parsed one completed first, by the input processor);
        never raises for a failed request (see ``error``)."""
        result = OmniResult(request_id=request.request_id)
        if isinstance(request, OmniRequest):
            try:
                request = await self.inputs.process(request)
            except InputError as exc:  # before any stage runs
                first = min(self.stages)
                result.exception = StageRequestError(str(exc), stage_id=first, request_id=request.request_id)
                result.error, result.error_stage = str(exc), first
                return result
        start = time.perf_counter()
        result.timings["queue"] = max(0.0, start - request.arrival_time)
        done: dict[int, asyncio.Future[Any]] = {
            sid: asyncio.get_running_loop().create_future() for sid in self.stages
        }
        budget = RetryBudget(request.request_id, self.deployment.max_retries, result.deaths)
        tasks = [
            asyncio.create_task(
                self._run_stage(sid, request, done, result, budget), name=f"{request.request_id}:{sid}"
            )
            for sid in self.stages
        ]
        try:
            with listen(request.request_id, request.on_event):
                await asyncio.gather(*tasks)
            result.output = self._final_output(done)
        except asyncio.CancelledError:
            await self._abort(request.request_id, tasks)
            self._release_undelivered(result)
            raise
        except StageError as exc:
            await self._abort(request.request_id, tasks)
            self._release_undelivered(result)
            result.error = str(exc)
            result.error_stage = exc.stage_id
            result.exception = exc
        except Exception as exc:  # a processor bug must fail its request, not the server
            logger.exception("request %s failed", request.request_id)
            await self._abort(request.request_id, tasks)
            self._release_undelivered(result)
            result.error = f"{type(exc).__name__}: {exc}"
            result.exception = exc
        result.timings["total"] = time.perf_counter() - start
        return result

    def _final_output(self, done: dict[int, asyncio.Future[Any]]) -> Any:
        """The final stage's output; when a processor skipped it (None), the output of the stage that
        answered instead (e.g. BAGEL's thinker for a text request)."""
        stage_id = self.final_stage
        while True:
            output = done[stage_id].result()
            sources = self.stages[stage_id].input_sources
            if output is not None or not sources:
                return output
            stage_id = sources[0]

    async def _run_stage(
        self,
        stage_id: int,
        request: OmniCoreRequest,
        done: dict[int, asyncio.Future[Any]],
        result: OmniResult,
        budget: RetryBudget,
    ) -> None:
        stage = self.stages[stage_id]
        try:
            sources = {sid: await asyncio.shield(done[sid]) for sid in stage.input_sources}
            async with self._admitted(stage_id, stage.input_sources):
                output = await self._run_with_retries(stage_id, request, sources, result, budget)
            if output is None:  # the processor left this stage nothing to do for this request
                done[stage_id].set_result(None)
                return
            for key, value in output.timings.items():
                result.timings[f"stage_{stage_id}_{key}"] = value
            result.stage_outputs[stage_id] = output
            done[stage_id].set_result(output)
        except BaseException as exc:
            if not done[stage_id].done():
                done[stage_id].set_exception(
                    exc if isinstance(exc, Exception) else RequestAbortedError("aborted")
                )
                done[stage_id].exception()  # mark retrieved: the gather reports it
            raise

    def _release_undelivered(self, result: OmniResult) -> None:
        """Payloads a stage produced for a next stage that did not finish with them (the request failed
        or was aborted in between, e.g. BAGEL's exported contexts) are freed now rather than when their
        lease runs out. A payload the next stage already read is left alone by its connector."""
        for sid, output in result.stage_outputs.items():
            for consumer in self.stages.values():
                if sid in consumer.input_sources and consumer.stage_id not in result.stage_outputs:
                    self._release_payload(sid, consumer.stage_id, output, result.request_id)

    def _release_payload(self, source: int, consumer: int, output: Any, request_id: str) -> None:
        connector = self.connectors.get(self.deployment.edge(source, consumer).connector)
        if connector is None:
            return
        try:
            release(output, connector)
        except Exception:  # best effort: the owner's lease frees what is left
            logger.exception("freeing stage %d's output of request %s failed", source, request_id)

    async def _run_with_retries(
        self,
        stage_id: int,
        request: OmniCoreRequest,
        sources: dict[int, Any],
        result: OmniResult,
        budget: RetryBudget,
    ) -> StageCoreOutput | None:
        """The stage's output for the request, run again after each replica death its budget allows.

        A diffusion stage runs it alone after a death it may have caused (``ran``): its batch's other
        requests each run alone too, so the one that kills the stage does so alone once more, and then
        fails (``QuarantinedError``) instead of taking anybody else down again."""
        alone = False
        while True:
            try:
                return await self._invoke(stage_id, request, sources, result, alone=alone)
            except StageDeadError as death:
                await self._after_death(stage_id, request.request_id, death, budget, alone=alone)
                alone = alone or (death.ran and self._runs_alone(stage_id))
                sources = await self._renewed_sources(stage_id, request, sources, result, budget)

    def _runs_alone(self, stage_id: int) -> bool:
        """Whether the stage can run a request alone (a diffusion stage: its batches are ours; an AR
        stage's engine batches as it pleases)."""
        return self.stages[stage_id].execution_type == "diffusion"

    async def _renewed_sources(
        self,
        stage_id: int,
        request: OmniCoreRequest,
        sources: dict[int, Any],
        result: OmniResult,
        budget: RetryBudget,
    ) -> dict[int, Any]:
        """The input for another run of ``stage_id``. A source output that carries connector handles
        (values a source stage's workers put themselves, e.g. BAGEL's context KV caches) is read once:
        the dead attempt may have taken it, so what is left of it is freed and its stage runs again
        (seeded, like every stage). Outputs held here in full are used as they are."""
        renewed = dict(sources)
        for sid, output in sources.items():
            if not carries_handles(output):
                continue
            self._release_payload(sid, stage_id, output, request.request_id)
            upstream = {s: result.stage_outputs[s] for s in self.stages[sid].input_sources}
            logger.info(
                "request %s: running stage %d again for stage %d's input", request.request_id, sid, stage_id
            )
            renewed[sid] = await self._run_with_retries(sid, request, upstream, result, budget)
            result.stage_outputs[sid] = renewed[sid]
        return renewed

    async def _invoke(
        self,
        stage_id: int,
        request: OmniCoreRequest,
        sources: dict[int, Any],
        result: OmniResult,
        *,
        alone: bool = False,
    ) -> StageCoreOutput | None:
        """One invocation of a stage from its input: the processor's request(s) of the stage's pool,
        round after round for a stage with a continuation; None when the processor leaves the stage
        nothing to do. ``alone``: its diffusion requests run alone.

        A ``StageDeadError`` from anywhere in it runs the whole invocation again, so whatever an attempt
        collected before a death (outputs carrying connector handles) it must release on the way out.
        """
        t0 = time.perf_counter()
        processor = self.processors.get(stage_id)
        if processor is None:
            raise StageError(f"stage {stage_id} has no input processor", stage_id=stage_id)
        context = ProcessorContext(self.deployment.model, self.deployment, stage_id, request, result.notes)
        stage_request = await input_work(processor, sources, context)
        t1 = time.perf_counter()
        result.timings[f"processor_{stage_id}"] = t1 - t0
        if stage_request is None:
            return None
        if stage_id not in self.pools:
            raise StageError(f"stage {stage_id} is not served by this deployment", stage_id=stage_id)
        output = await self.pools[stage_id].generate(_as_sent(stage_request, request, alone))
        continuation = self.continuations.get(stage_id)
        while continuation is not None:
            stage_request = await input_work(continuation, output, context)
            if stage_request is None:
                break
            output = await self.pools[stage_id].generate(_as_sent(stage_request, request, alone))
        t2 = time.perf_counter()
        result.intervals.append(StageInterval(stage_id, t1, t2))
        result.timings[f"stage_{stage_id}"] = t2 - t1
        return output

    async def _after_death(
        self, stage_id: int, request_id: str, death: StageDeadError, budget: RetryBudget, *, alone: bool
    ) -> None:
        """A replica died under the request: spend a retry (or give up: quarantined where it died running
        ``alone``) and clear what the abandoned attempt left on the stage's replicas."""
        if not death.retryable:
            raise death
        if not budget.spend(death):
            if alone and death.ran:
                self.quarantined[stage_id] += 1
                raise budget.quarantined(stage_id) from death
            self.exhausted[stage_id] += 1
            raise budget.exhausted(stage_id, death) from death
        self.retries[stage_id] += 1
        spent = len(budget.deaths) - budget.queued_deaths
        logger.warning(
            "request %s: %s; running stage %d again (%s)",
            request_id,
            death,
            stage_id,
            "it only waited: no retry spent"
            if death.where == "queued"
            else f"retry {spent} of {budget.max_retries}",
        )
        await self.pools[stage_id].abort([request_id])

    @contextlib.asynccontextmanager
    async def _admitted(self, stage_id: int, sources: list[int]) -> AsyncIterator[None]:
        """Hold a place on every limited edge into ``stage_id`` while the stage works on the request."""
        async with contextlib.AsyncExitStack() as places:
            for source in sources:
                limit = self.edge_limits.get((source, stage_id))
                if limit is not None:
                    await places.enter_async_context(limit)
            yield

    async def _abort(self, request_id: str, tasks: list[asyncio.Task[Any]]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(
            *(pool.abort([request_id]) for pool in self.pools.values()), return_exceptions=True
        )


def _as_sent(stage_request: Any, request: OmniCoreRequest, alone: bool) -> Any:
    """The stage request as its pool gets it: an AR stage's (and its companions) with the request's AR
    priority; a diffusion stage's run alone where ``alone`` is asked."""
    if isinstance(stage_request, StageLLMCoreRequest) and request.ar_priority:
        companions = {
            name: msgspec.structs.replace(c, priority=request.ar_priority)
            for name, c in stage_request.companions.items()
        }
        return msgspec.structs.replace(stage_request, priority=request.ar_priority, companions=companions)
    if alone and isinstance(stage_request, StageDiffusionCoreRequest):
        return msgspec.structs.replace(stage_request, alone=True)
    return stage_request
