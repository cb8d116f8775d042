"""``StageLLMCoreClient``: the AR stage on vLLM's own engine client stack.

One replica is one vLLM ``AsyncLLM`` (input processing, detokenization and the ``EngineCore`` process
are vLLM's), built from the resolved ``EngineArgs`` that carry our ``scheduler_cls`` and ``worker_cls``.
When its engine core dies, the in-flight requests fail with ``StageDeadError`` (the orchestrator runs them
again) and a new engine is started once what the dead one's processes left is removed.

A restarted engine does not profile the device again: the stage it shares may have grown meanwhile (a
DiT serving on the same GPU), so profiling would find less memory and give a smaller KV cache, or fail
vLLM's "Error in memory profiling" check. It gets the KV cache its first start measured instead
(``kv_cache_memory_bytes``, with which vLLM skips profiling, and ``num_gpu_blocks_override``, so the
block count is the same whatever vLLM's per-block arithmetic), unless the deploy file fixed the size.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from vllm_omni_plugin.ar_channel import stage_outputs_of
from vllm_omni_plugin.compat import engine_core_pids, resolve
from vllm_omni_plugin.log import best_effort, get_logger
from vllm_omni_plugin.processes import ProcessTree, spawning_without_main, temporary_environment
from vllm_omni_plugin.runtime_dir import engine_dir, engine_env, note_segments, remove_engine_dir
from vllm_omni_plugin.stage.core_client import StageCoreClientBase, StageState
from vllm_omni_plugin.stage.core_types import StageLLMCoreOutput, StageLLMCoreRequest
from vllm_omni_plugin.stage.errors import (
    RequestAbortedError,
    StageDeadError,
    StageError,
    StageRequestError,
    StageStartError,
)
from vllm_omni_plugin.stage.request_events import ARProgress, listening, publish
from vllm_omni_plugin.stage.tokenizer_view import tokenizer_view

logger = get_logger(__name__)

EXIT_GRACE_S = 10.0
"""How long a stopped or dead engine's processes (EngineCore, workers) get to exit before SIGKILL."""
KV_REUSE_FIXED_BY = ("kv_cache_memory_bytes", "num_gpu_blocks_override")
"""Engine arguments with which the deploy file (or command line) fixed the KV cache: nothing is reused."""
ENGINE_DIED = "its vLLM engine core exited"


def scheduler_state_logger(state: dict[str, Any]) -> Any:
    """A vLLM stat-logger factory that keeps the engine's latest scheduler stats in ``state``."""
    StatLoggerBase = resolve("StatLoggerBase")

    class SchedulerStateLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
            if scheduler_stats is not None:
                state.update(
                    running=scheduler_stats.num_running_reqs,
                    waiting=scheduler_stats.num_waiting_reqs,
                    kv_cache_usage=round(float(scheduler_stats.kv_cache_usage), 6),
                )

        def log_engine_initialized(self) -> None:
            pass

    return SchedulerStateLogger


class StageLLMCoreClient(StageCoreClientBase):
    def __init__(
        self,
        stage_id: int,
        replica_id: int,
        engine_args: dict[str, Any],
        *,
        name: str = "ar",
        env: dict[str, str] | None = None,
        default_sampling_params: dict[str, Any] | None = None,
        restart: bool = True,
    ) -> None:
        super().__init__(stage_id, replica_id, name, restart=restart)
        self.engine_args = dict(engine_args)
        self.env = dict(env or {})
        self.default_sampling_params = dict(default_sampling_params or {})
        self.engine: Any = None
        """vLLM's ``AsyncLLM`` while the replica runs."""
        self.processes = ProcessTree(self.label)
        """The engine's processes and the shared memory they map (removed once they are gone)."""
        self._restarting: asyncio.Task[None] | None = None
        self.scheduler_state: dict[str, Any] = {}
        """The engine's last reported scheduler state (running and waiting requests, KV-cache usage),
        from vLLM's own per-step stats; in ``/health``."""
        self.kv_cache_args: dict[str, int] = {}
        """The KV cache the first start measured (``kv_cache_memory_bytes``, ``num_gpu_blocks_override``),
        which every restart reuses; empty before the first start and when the engine arguments fix it."""
        self.kv_cache_blocks: int | None = None
        """KV-cache blocks of the running engine (vLLM's ``num_gpu_blocks``), in ``/health``."""
        self.endpoints: str | None = None
        """The directory of the engine's IPC endpoints and temp files (``runtime_dir.engine_dir``)."""

    def launch_args(self) -> dict[str, Any]:
        """The engine arguments of the next start: the resolved ones, plus the measured KV cache."""
        return {**self.engine_args, **self.kv_cache_args}

    holds_environment_while_loading = True

    async def start(self) -> None:
        await self._launch()

    async def _launch(self) -> None:
        AsyncEngineArgs = resolve("AsyncEngineArgs")
        AsyncLLM = resolve("AsyncLLM")
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        logger.info("%s starting (vLLM engine)", self.label)

        def build() -> Any:
            args = self.launch_args()
            if args.get("tokenizer") and args.get("model"):
                args["tokenizer"] = tokenizer_view(args["tokenizer"], args["model"])
            # the engine's endpoints and temp files in a directory of its own (runtime_dir.py)
            self.endpoints = engine_dir(f"ar{self.stage_id}-{self.replica_id}")
            env = {**self.env, **engine_env(self.endpoints)}
            with temporary_environment(env), spawning_without_main():
                engine = AsyncLLM.from_engine_args(
                    AsyncEngineArgs(**args), stat_loggers=[scheduler_state_logger(self.scheduler_state)]
                )
            self.processes = ProcessTree(self.label).record(_first(engine_core_pids(engine)))
            note_segments(self.endpoints, self.processes.segments)
            if self.state == StageState.STOPPED:  # stopped while it started (interrupted): nobody will use it
                engine.shutdown()
                self.processes.stop(EXIT_GRACE_S)
                raise StageStartError(f"{self.label} was stopped while it started", stage_id=self.stage_id)
            return engine

        try:
            self.engine = await loop.run_in_executor(None, build)
        except Exception as exc:
            raise StageStartError(f"{self.label} failed to start: {type(exc).__name__}: {exc}") from exc
        self._record_kv_cache(self.engine.vllm_config)
        self.state = StageState.READY
        logger.info("%s ready (vLLM engine, %.1fs)", self.label, time.perf_counter() - start)

    def _record_kv_cache(self, vllm_config: Any) -> None:
        """After the first start: the KV cache vLLM chose, as the arguments that give it again."""
        self.kv_cache_blocks = vllm_config.cache_config.num_gpu_blocks
        if self.kv_cache_args or any(self.engine_args.get(k) is not None for k in KV_REUSE_FIXED_BY):
            return
        measured = measured_kv_cache(vllm_config)
        if measured is None:
            logger.info("%s: its KV cache size cannot be measured; a restart profiles again", self.label)
            return
        blocks, size = measured
        self.kv_cache_args = {"kv_cache_memory_bytes": size, "num_gpu_blocks_override": blocks}
        logger.info(
            "%s: KV cache of %d blocks (%.2f GiB); a restart reuses it instead of profiling the device",
            self.label,
            blocks,
            size / 2**30,
        )

    @property
    def pid(self) -> int | None:
        return _first(engine_core_pids(self.engine)) if self.engine is not None else None

    def health(self) -> dict[str, Any]:
        return {**super().health(), "kv_cache_blocks": self.kv_cache_blocks, **self.scheduler_state}

    async def log_stats(self) -> None:
        if self.engine is not None and self.healthy:
            await self.engine.do_log_stats()
            self.last_connector_stats = await self.connector_stats()

    async def connector_stats(self) -> list[dict[str, Any]]:
        """The context-export connector of each worker of the engine (KV-handoff pipelines)."""
        if self.engine is None or not self.healthy:
            return []
        replies = await self.engine.collective_rpc("omni_context_connector_health")
        return [reply for reply in replies if reply]

    def sampling_params(self, overrides: dict[str, Any]) -> Any:
        SamplingParams = resolve("SamplingParams")
        return SamplingParams(**{**self.default_sampling_params, **overrides})

    async def generate(self, request: StageLLMCoreRequest) -> StageLLMCoreOutput:
        """Run a request, and its companions beside it in the same engine (all must finish)."""
        if not request.companions:
            return await self._run(request)
        main = asyncio.ensure_future(self._run(request))
        companions = {name: asyncio.ensure_future(self._run(r)) for name, r in request.companions.items()}
        everything = [main, *companions.values()]
        try:
            output = await main
            if companions:
                done, pending = await asyncio.wait(companions.values(), timeout=request.companion_timeout_s)
                if pending:
                    missing = sorted(name for name, task in companions.items() if task in pending)
                    raise StageError(
                        f"the {', '.join(missing)} context(s) of this request did not arrive within "
                        f"{request.companion_timeout_s:g} s of the main one",
                        stage_id=self.stage_id,
                        request_id=request.request_id,
                    )
            output.companions = {name: task.result() for name, task in companions.items()}
            return output
        finally:
            for task in everything:
                if not task.done():
                    task.cancel()
            # Settle every task (a failure of one is the request's failure, already raised).
            await asyncio.gather(*everything, return_exceptions=True)

    async def _run(self, request: StageLLMCoreRequest) -> StageLLMCoreOutput:
        if self.state != StageState.READY or self.engine is None:
            raise StageDeadError(
                f"{self.label} is {self.state.value}", stage_id=self.stage_id, where="unsent"
            )
        EngineDeadError = resolve("EngineDeadError")
        prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
        if request.multi_modal_data:
            prompt["multi_modal_data"] = request.multi_modal_data
        if request.mm_processor_kwargs:
            prompt["mm_processor_kwargs"] = request.mm_processor_kwargs
        try:
            params = self.sampling_params(request.sampling_params)
        except Exception as exc:
            raise StageRequestError(f"bad sampling parameters: {exc}", stage_id=self.stage_id) from exc
        self.inflight.add(request.request_id)
        start = time.perf_counter()
        final = None
        progress = _Progress(self.stage_id, request.request_id, params.max_tokens, params.detokenize)
        try:
            async for output in self.engine.generate(
                prompt, params, request_id=request.request_id, priority=request.priority
            ):
                final = output
                progress.report(output)
        except EngineDeadError as exc:
            self._on_engine_dead()
            raise StageDeadError(
                f"{self.label} died ({ENGINE_DIED}) while serving this request",
                stage_id=self.stage_id,
                request_id=request.request_id,
            ) from exc
        except asyncio.CancelledError:
            if self.engine is not None:
                # Counted and sent before any await: a second cancellation (the request's other tasks
                # being torn down) must not interrupt the abort, nor lose its count.
                self.dropped["engine"] += 1
                with best_effort("aborting a cancelled request in the AR engine", logger):
                    await asyncio.shield(self.engine.abort(request.request_id))
            raise
        finally:
            self.inflight.discard(request.request_id)
        if final is None or not final.outputs:
            raise StageError("the AR stage produced no output", stage_id=self.stage_id)
        completion = final.outputs[0]
        finish_reason = completion.finish_reason
        if finish_reason == "abort":
            raise RequestAbortedError("aborted", stage_id=self.stage_id, request_id=request.request_id)
        if finish_reason == "error":
            raise StageError(
                f"the AR stage failed this request ({completion.stop_reason or 'engine error'})",
                stage_id=self.stage_id,
                request_id=request.request_id,
            )
        stage_outputs = stage_outputs_of(final.kv_transfer_params)
        return StageLLMCoreOutput(
            request_id=request.request_id,
            stage_id=self.stage_id,
            token_ids=list(completion.token_ids),
            text=completion.text if params.detokenize else None,
            num_prompt_tokens=len(final.prompt_token_ids or ()),
            finish_reason=finish_reason,
            stage_outputs=stage_outputs,
            timings={"ar": time.perf_counter() - start},
        )

    def _on_engine_dead(self) -> None:
        if self.state != StageState.READY:
            return
        self.replica_died(ENGINE_DIED)
        if self._restarting is None:
            self._restarting = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        """End what is left of the dead engine (its workers: killed at once, they have nothing to finish
        without their core), remove the shared memory its processes left, then start a new engine unless
        the replica stays down. The new engine starts only once the old processes are gone: on a GPU they
        hold its memory."""
        old, self.engine = self.engine, None
        with best_effort("shutting down the dead AR engine", logger):
            old.shutdown()
        try:
            await asyncio.to_thread(self.processes.end)
            if not self.restart_on_death or self.state == StageState.STOPPED:
                return
            self.restarts += 1
            await self._launch()
        except StageError as exc:
            if self.state != StageState.STOPPED:
                logger.error("%s could not be restarted: %s", self.label, exc)
                self.state = StageState.DEAD
        finally:
            self._restarting = None

    async def abort(self, request_ids: list[str]) -> None:
        if self.engine is not None:
            with best_effort("aborting requests in the AR engine", logger):
                await self.engine.abort(list(request_ids))

    async def shutdown(self) -> None:
        """Stop the engine and wait until its processes are gone and their shared memory removed (a
        container runtime SIGKILLs whatever outlives the main process, and with it anything it held)."""
        self.state = StageState.STOPPED
        if self._restarting is not None:  # a restart under way finishes first; what it started stops below
            with best_effort("waiting for the AR engine restart under way", logger):
                await self._restarting
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await asyncio.to_thread(self.processes.record, _first(engine_core_pids(engine)))
            # On this loop's thread: vLLM cancels its output handler before stopping the engine core,
            # so the handler never sees a dead engine (and logs no EngineDeadError).
            engine.shutdown()
        await asyncio.to_thread(self.processes.stop, EXIT_GRACE_S)
        if self.endpoints is not None:
            remove_engine_dir(self.endpoints)


def _first(pids: list[int]) -> int | None:
    return pids[0] if pids else None


def kv_cache_dtype_bytes(cache_dtype: str, model_dtype: Any) -> int | None:
    """Bytes per KV element for vLLM's ``cache_dtype`` (``auto``: the model's dtype); None when the cache
    keeps scales beside its values (its size is not elements x bytes)."""
    if cache_dtype == "auto":
        return int(getattr(model_dtype, "itemsize", 0)) or None
    if "per_token_head" in cache_dtype or cache_dtype.startswith("nvfp4"):
        return None
    if cache_dtype.startswith("fp8") or cache_dtype == "int8":
        return 1
    return {"bfloat16": 2, "float16": 2, "half": 2, "float": 4, "float32": 4}.get(cache_dtype)


def measured_kv_cache(vllm_config: Any) -> tuple[int, int] | None:
    """(blocks, bytes) of a started engine's KV cache, per worker: ``num_gpu_blocks`` (what the engine
    core reported) times each block's bytes (layers x K and V x KV heads x head size x dtype, vLLM's page
    size of full attention). None where that product is not the engine's allocation: models with layers
    other than attention (hybrid, attention-free), pipeline or data parallelism (blocks per worker differ
    from the reported sum), a cache with scales."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    blocks = cache.num_gpu_blocks
    if not blocks or parallel.pipeline_parallel_size != 1 or parallel.data_parallel_size != 1:
        return None
    if model.is_hybrid or model.is_attention_free or getattr(model, "has_noops", False):
        return None
    element = kv_cache_dtype_bytes(str(cache.cache_dtype), model.dtype)
    if element is None:
        return None
    layers = model.get_num_layers_by_block_type(parallel, "attention")
    kv = 1 if model.use_mla else 2  # MLA keeps one latent vector per token
    per_block = cache.block_size * layers * kv * model.get_num_kv_heads(parallel) * model.get_head_size()
    return int(blocks), int(blocks) * per_block * element


class _Progress:
    """A streamed request's AR progress (``request_events.ARProgress``): about every twentieth of its
    tokens and its last, or every step where it writes text for the client; nothing for a request nobody
    streams."""

    STEPS = 20

    def __init__(self, stage_id: int, request_id: str, total: int | None, text: bool) -> None:
        self.stage_id, self.request_id, self.total, self.text = stage_id, request_id, total or 0, text
        self.next = 1

    def report(self, output: Any) -> None:
        if not self.total or not output.outputs or not listening(self.request_id):
            return
        completion = output.outputs[0]
        tokens = len(completion.token_ids)
        if self.text or tokens >= self.next or output.finished:
            self.next = tokens + max(1, self.total // self.STEPS)
            text = completion.text if self.text else None
            publish(self.request_id, ARProgress(self.stage_id, tokens, self.total, text))
