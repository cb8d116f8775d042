"""``Orchestrator``: runs each request through the resolved pipeline graph.

Every stage of a request is an asyncio task that waits for its source stages, calls the stage-input
processor the pipeline names (entry stages build their input from the user's request), and submits to
that stage's replica pool. Requests are independent tasks, so stages overlap: while the DiT denoises
request n, the AR engine decodes request n+1, and each stage batches what it has. An edge with
``max_inflight`` lets that many requests into its consuming stage at once; the others wait with their
source's output. Cancelling a request aborts it in every stage. Per-request timings record queue, each
stage, the processors and transfers, with absolute intervals so overlap can be checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_plugin.config.resolved import ResolvedDeployment
from vllm_omni_plugin.connectors.base import OmniConnector
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.errors import RequestAbortedError, StageError
from vllm_omni_plugin.stage.payload import release
from vllm_omni_plugin.stage.replica_pool import StageReplicaPool

logger = get_logger(__name__)


@dataclass
class OmniRequest:
    """What a user asks for (the API server and the offline API build these)."""

    prompt: str
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    negative_prompt: str | None = None
    images: list[Any] = field(default_factory=list)
    """Source images for image-to-image (PIL images or uint8 arrays)."""
    sampling_params: dict[str, Any] = field(default_factory=dict)
    """AR sampling overrides (e.g. ``{"temperature": 0}`` for greedy decoding)."""
    modality: str = "image"
    """What the client wants back: ``"image"``, or ``"text"`` from pipelines whose AR stage can answer in
    text (BAGEL's understanding and chat; the later stages are then skipped)."""
    think: bool | None = None
    """Let the AR stage write its reasoning or plan first (BAGEL's think mode); None: the deployment's
    default."""
    generation_params: dict[str, Any] = field(default_factory=dict)
    """The pipeline's own generation settings (e.g. BAGEL's ``cfg_text_scale``); the pipeline's
    processors read and check them."""
    return_latents: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival_time: float = field(default_factory=time.perf_counter)
    """When the request arrived (``time.perf_counter``); the gap to its start is its queue time."""


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

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class ProcessorContext:
    """What a stage-input processor may use besides the outputs of its sources."""

    model: str
    deployment: ResolvedDeployment
    stage_id: int
    request: OmniRequest
    notes: dict[str, Any] = field(default_factory=dict)
    """Shared by every processor call of one request and returned with its result (``OmniResult.notes``)."""


class Orchestrator:
    def __init__(
        self,
        deployment: ResolvedDeployment,
        pools: dict[int, StageReplicaPool],
        connectors: dict[str, OmniConnector] | None = None,
    ) -> None:
        self.deployment = deployment
        self.pools = pools
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

    async def generate(self, request: OmniRequest) -> OmniResult:
        """Run one request through every stage; never raises for a failed request (see ``error``)."""
        result = OmniResult(request_id=request.request_id)
        start = time.perf_counter()
        result.timings["queue"] = max(0.0, start - request.arrival_time)
        done: dict[int, asyncio.Future[Any]] = {
            sid: asyncio.get_running_loop().create_future() for sid in self.stages
        }
        tasks = [
            asyncio.create_task(
                self._run_stage(sid, request, done, result), name=f"{request.request_id}:{sid}"
            )
            for sid in self.stages
        ]
        try:
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
        self, stage_id: int, request: OmniRequest, done: dict[int, asyncio.Future[Any]], result: OmniResult
    ) -> None:
        stage = self.stages[stage_id]
        try:
            sources = {sid: await asyncio.shield(done[sid]) for sid in stage.input_sources}
            async with self._admitted(stage_id, stage.input_sources):
                t0 = time.perf_counter()
                processor = self.processors.get(stage_id)
                if processor is None:
                    raise StageError(f"stage {stage_id} has no input processor", stage_id=stage_id)
                context = ProcessorContext(
                    self.deployment.model, self.deployment, stage_id, request, result.notes
                )
                stage_request = processor(sources, context)
                t1 = time.perf_counter()
                result.timings[f"processor_{stage_id}"] = t1 - t0
                if stage_request is None:  # nothing for this stage to do for this request
                    done[stage_id].set_result(None)
                    return
                if stage_id not in self.pools:
                    raise StageError(f"stage {stage_id} is not served by this deployment", stage_id=stage_id)
                output = await self.pools[stage_id].generate(stage_request)
                continuation = self.continuations.get(stage_id)
                while (
                    continuation is not None and (stage_request := continuation(output, context)) is not None
                ):
                    output = await self.pools[stage_id].generate(stage_request)
                t2 = time.perf_counter()
            result.intervals.append(StageInterval(stage_id, t1, t2))
            result.timings[f"stage_{stage_id}"] = t2 - t1
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
                if sid not in consumer.input_sources or consumer.stage_id in result.stage_outputs:
                    continue
                connector = self.connectors.get(self.deployment.edge(sid, consumer.stage_id).connector)
                if connector is None:
                    continue
                try:
                    release(output, connector)
                except Exception:  # best effort: the owner's lease frees what is left
                    logger.exception("freeing stage %d's output of request %s failed", sid, result.request_id)

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
