"""The diffusion engine: one loaded pipeline, batches of compatible requests, one result per request.

Batching must not change what a request gets: each request draws its noise from its own seeded generator
(diffusers takes a list of generators, one per batch row) and requests share a pipeline call only when
everything that shapes the call matches. What batching cannot remove is floating-point noise: CPU and GPU
kernels pick batch-size dependent algorithms (e.g. oneDNN convolutions, GEMV for one row against GEMM for
several), so a batched image can differ from the same request run alone by ~1e-6 before quantization
(at most 1/255 in a few uint8 pixels). ``batch_invariant=True`` runs every request in its own call, for
bit-exact reproducibility at the cost of throughput.

A request aborted while it waits is not run; a batch whose every request is aborted stops at the end of
the running step (no decode, no image). A request aborted alone inside a batch shared with others cannot
leave the batch, whose tensors it is a row of: its row is finished with the batch, and whoever aborted it
drops its image. With ``batching: step`` its rows leave the shared forwards at its group's next step
(:meth:`StepBatcher.track`): the rest of the group runs without them.

With a memory budget (``gpu_memory_utilization``, see :mod:`vllm_omni_plugin.diffusion.memory`), a batch
takes requests only while the runner's estimate of their activations fits what the budget leaves after
the weights; the others run in the next batch, and a request that does not fit alone fails as invalid.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from vllm_omni_plugin.diffusion.blocks import CompileSpec
from vllm_omni_plugin.diffusion.cfg_parallel import RowParallelDenoiser
from vllm_omni_plugin.diffusion.diffusers_registry import pipeline_class_name, runner_class
from vllm_omni_plugin.diffusion.engine_config import DiffusionEngineConfig
from vllm_omni_plugin.diffusion.memory import (
    MemoryBudget,
    allocated_bytes,
    device_memory_bytes,
    gib,
)
from vllm_omni_plugin.diffusion.params import DiffusionCounters, DiffusionResult, RunnerRequest
from vllm_omni_plugin.diffusion.peer_group import DenoiserGroup
from vllm_omni_plugin.diffusion.quantization import check as check_quantization
from vllm_omni_plugin.diffusion.quantization import component_weights, describe_weights
from vllm_omni_plugin.diffusion.runner import (
    BatchAborted,
    DiffusionRunner,
    PreviewCallback,
    RunnerContext,
)
from vllm_omni_plugin.diffusion.sequence_parallel import SequenceParallelDenoiser, sequence_plan
from vllm_omni_plugin.diffusion.step_batching import StepBatcher, latent_elements
from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

MAX_SEED = 2**63 - 1
MAX_STEP_TOKENS = {"cpu": 1024}
"""The default ``max_step_tokens`` by device type: where a CPU denoiser forward stops gaining from more
rows, so a real model's request runs alone (``benchmarks/diffusion_engine.py --max-step-tokens``)."""
GPU_STEP_TOKENS = 16384
"""The default elsewhere: two guided 1024x1024 requests of SD3 or FLUX, where a GPU's forward is about
compute-bound."""
DECODE_LATENTS_PER_CALL = {"cpu": 16384}
"""``batching: step``: the most latent elements (rows x channels x latent height x width) one joined VAE
decode takes, by device type: a few small images per call, where joining still pays on CPU."""
GPU_DECODE_LATENTS = 1 << 20
"""Elsewhere: 4 megapixels of a 16-channel, 8x VAE per call."""
ABORTED = "aborted"

IsAborted = Callable[[str], bool]
"""Whether the request with this id was aborted (asked before and during its batch)."""


def torch_dtype(name: Any, device: Any = "cpu") -> Any:
    """A ``torch.dtype`` from a name (``"bfloat16"``, ``"torch.float16"``, ``"auto"``/``None``)."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    key = str(name).removeprefix("torch.")
    aliases = {
        "half": "float16",
        "float": "float32",
        "bf16": "bfloat16",
        "fp16": "float16",
        "fp32": "float32",
    }
    dtype = getattr(torch, aliases.get(key, key), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown floating-point dtype {name!r}")
    return dtype


class DiffusionEngine:
    """Runs a :class:`DiffusionRunner` (a diffusers pipeline's, chosen by ``model_index.json``, or the one
    the pipeline names: ``runner_cls``) on batches of its requests.

    Requests arrive complete (the input processor filled their defaults); ``seed`` seeds the draw of seeds
    for unseeded requests. A batch that runs longer than ``progress_interval_s`` logs its requests' step
    progress every that many seconds.
    ``gpu_memory_utilization``: the share of the device's memory (the machine's on CPU) the stage keeps
    to; batches are formed within what it leaves after the weights (``memory``). ``max_step_tokens``: the
    most latent tokens a step carries over the requests of a batch (:meth:`DiffusionRunner.step_tokens`);
    default by device (:data:`MAX_STEP_TOKENS`).
    """

    def __init__(
        self,
        model: str | Path,
        config: DiffusionEngineConfig | None = None,
        *,
        device: Any = "cpu",
        runner: DiffusionRunner | None = None,
    ) -> None:
        import torch

        config = config or DiffusionEngineConfig()
        self.config = config
        self.model = str(model)
        self.device = torch.device(device)
        self.dtype = torch_dtype(config.dtype, self.device)
        self.max_batch_size = max_batch_size = config.max_batch_size
        device_default = MAX_STEP_TOKENS.get(self.device.type, GPU_STEP_TOKENS)
        self.max_step_tokens = config.max_step_tokens or device_default
        self.batch_invariant = batch_invariant = config.batch_invariant
        start = time.perf_counter()
        if runner is None:
            runner = self._load_runner(config)
        self.runner: DiffusionRunner = runner
        self.load_seconds = time.perf_counter() - start
        self.weights = [
            component_weights(name, objects, self.dtype)
            for name, objects in runner.weight_components().items()
        ]
        """Each part of the model's weights as loaded (quantized where the stage says so)."""
        self.weight_bytes = sum(w.bytes for w in self.weights)
        logger.info("diffusion engine %s", describe_weights(self.weights))
        self.memory: MemoryBudget | None = None
        """The stage's memory budget, its weights measured (None: no budget, batches by size only)."""
        if config.gpu_memory_utilization is not None:
            self.memory = self._measure_budget(config.gpu_memory_utilization)
        self.request_type: type[RunnerRequest] = runner.request_type
        """What this engine's runner takes."""
        self._seeds = random.Random(config.seed)
        self.progress_interval_s = config.progress_interval_s
        self._counters = DiffusionCounters()
        """What ran since load (:meth:`counters`); written under ``_count_lock`` (groups count from their
        own threads)."""
        self._count_lock = threading.Lock()
        self.on_progress: Callable[[], None] | None = None
        """Called after every step of whole-request batching (a stage process then reports
        :meth:`counters` to ``/metrics``)."""
        self._progress: _BatchProgress | None = None
        self._in_flight: dict[int, _BatchProgress] = {}
        """The batch or groups the runner is working on, by id (:meth:`request_steps`); under
        ``_count_lock``."""
        self.on_preview: PreviewCallback | None = None
        """Where the previews requests ask for (``partial_images``) go (set by the host's batch loop);
        called from the thread that runs the request."""
        if config.vae_tiling == "always" and not runner.tiles_decode:
            raise ValueError(f"vae_tiling: always: {runner.label}'s decoder does not tile; remove vae_tiling")
        self.context = RunnerContext(
            on_step=self._step_done,
            on_preview=self._preview if runner.previews else None,
            on_cache_counts=self._cache_counted,
            max_loras=config.max_loras,
            vae_tiling=config.vae_tiling,
            decode_budget=self.memory.activation_bytes if self.memory is not None else None,
        )
        """What the runner reads of this engine (its one seam to it): callbacks, settings, and what
        :meth:`_start` starts (the decode batcher, a parallel replica's denoiser)."""
        runner.attach(self.context)
        self.cache = config.cache
        """The stage's step caching settings (requests override them field by field); None: off."""
        if self.cache is not None and self.cache.active and not runner.step_cache:
            raise ValueError(f"step caching is not available for {runner.label}; remove the cache block")
        self.parallel: DenoiserGroup | None = None
        """A CFG- or sequence-parallel replica's group (``cfg_parallel_size`` or ``sequence_parallel_size``
        > 1): its peers compute their share of every denoiser forward's rows, or of its image tokens."""
        self.compile = config.compile
        """Regional compilation of the denoiser's blocks (None: eager); compiled and warmed up here."""
        compiles = self.compile is not None and self.compile.active
        if config.sequence_parallel_size > 1 and compiles:
            raise ValueError(
                "sequence_parallel_size: compiled blocks would trace its exchanges; remove the compile block"
            )
        if compiles:
            self._check_compile()
        batching = config.batching
        if batching == "step" and (not runner.step_batching or batch_invariant):
            why = "batch_invariant runs requests alone" if batch_invariant else f"{runner.label} cannot"
            raise ValueError(f"batching: step is not available: {why}; use batching: request")
        self.step_family: Any = None
        """``batching: loop``: the pipeline as the step loop's pieces (``diffusion/step_loop.py``)."""
        if batching in (None, "loop"):
            family = runner.step_family()
            if batching == "loop" and (family is None or batch_invariant):
                why = "batch_invariant runs requests alone" if batch_invariant else (
                    f"{runner.label} has no step-loop pieces yet"
                )  # fmt: skip
                raise ValueError(f"batching: loop is not available: {why}; use batching: request")
            # unset: the step loop where the pipeline has its pieces and requests may share steps
            batching = "loop" if family is not None and not batch_invariant else "request"
            self.step_family = family if batching == "loop" else None
        self.batching: str = batching
        """What the stage runs: ``request``, ``step`` or ``loop`` (``batching`` unset: ``loop`` where it
        can, else ``request``)."""
        self.decode_batcher: StepBatcher | None = None
        """``batching: step``: the groups' VAE decodes, joined where several wait (runners with a
        :meth:`DiffusionRunner.decode_calls`)."""
        self.step_batcher: StepBatcher | None = None
        """``batching: step``: groups of requests in flight share denoiser forwards step by step
        (:meth:`run_group`); ``None``: whole requests batch (:meth:`generate`)."""
        self.batch_wait_ms = config.batch_wait_ms
        """``batching: step``: while requests run, how long a new request waits for others to start with
        it as one group (one pipeline call: its prompt encoding and decode batched)."""
        overlap = config.overlap_decode
        self.overlap_decode = self.device.type != "cpu" if overlap is None else overlap
        """``batching: loop``: finished requests decode beside the next step (unset: on an accelerator)."""
        self.compile_seconds = 0.0
        # Everything checkable is checked above, before any peer process starts; what fails from here on
        # (a peer that cannot load, a warm-up request) stops what started before the error goes up.
        try:
            self._start(config, compiles)
        except BaseException:
            self.close()
            raise
        logger.info(
            "diffusion engine: %s (%s) on %s, %s, max_batch_size %d, max_step_tokens %d, %s batching%s%s, "
            "step cache %s, load %.2f s",
            self.model,
            runner.label,
            self.device,
            self.dtype,
            max_batch_size,
            self.max_step_tokens,
            batching,
            ", batch-invariant" if batch_invariant else "",
            (", decoding beside the steps" if self.overlap_decode else ", decoding between steps")
            if batching == "loop"
            else "",
            self.cache.describe() if self.cache is not None else "off",
            self.load_seconds,
        )

    def _load_runner(self, config: DiffusionEngineConfig) -> DiffusionRunner:
        """The runner the pipeline names (its model is no diffusers pipeline: ``runner_cls``), else the
        one registered for its ``model_index.json`` class, loaded (and quantized) on the device."""
        cls = (
            _runner_class(config.runner_cls)
            if config.runner_cls
            else runner_class(pipeline_class_name(self.model))
        )
        spec = config.quantization
        if spec is None or not spec.active:
            return cls.load(self.model, dtype=self.dtype, device=self.device)
        if not cls.quantizes:
            raise ValueError(
                f"quantization is not available for {cls.__name__}; remove the quantization block"
            )
        check_quantization(spec, self.device, self.dtype)
        return cls.load(self.model, dtype=self.dtype, device=self.device, quantization=spec)

    def _start(self, config: DiffusionEngineConfig, compiles: bool) -> None:
        """What starts processes and threads: the parallel group's peers, the compiled blocks and their
        warm-up, the step and decode batchers."""
        runner = self.runner
        if config.cfg_parallel_size > 1:
            self.parallel = self._start_group(config.cfg_parallel_size, "cfg")
        elif config.sequence_parallel_size > 1:
            self.parallel = self._start_group(config.sequence_parallel_size, "sequence")
        if compiles:
            assert self.compile is not None
            self._compile(self.compile)
        if self.batching == "step":
            self.step_batcher = StepBatcher(
                self.context.parallel_denoiser or runner.denoiser(),
                max_rows=2 * self.max_batch_size,
                joins=runner.step_joins(),
                on_boundary=self._boundary_done,
            )
            decoder = runner.decode_calls()
            if decoder is not None:
                self.decode_batcher = StepBatcher(
                    decoder,
                    max_rows=DECODE_LATENTS_PER_CALL.get(self.device.type, GPU_DECODE_LATENTS),
                    row_weight=latent_elements,
                    name="dit-decode",
                )
                self.context.decode_batcher = self.decode_batcher

    def _measure_budget(self, fraction: float) -> MemoryBudget:
        """The budget with the weights as loaded: the allocator's count on CUDA, else the runner's
        tensors. A budget the weights leave nothing of is a start-up error, not a stage that refuses
        every request."""
        weights = allocated_bytes(self.device)
        if weights is None:
            weights = self.weight_bytes
        budget = MemoryBudget(
            fraction=fraction,
            device=str(self.device),
            device_bytes=device_memory_bytes(self.device),
            weight_bytes=weights,
        )
        if budget.activation_bytes <= 0:
            raise ValueError(
                "the diffusion stage's memory budget holds its weights and nothing more: "
                f"{budget.describe()}; raise gpu_memory_utilization"
            )
        logger.info("diffusion engine memory: %s", budget.describe())
        return budget

    def activation_bytes(self, batch: Sequence[Any]) -> int:
        """The runner's estimate of the activations of ``batch`` run as one call."""
        return int(self.runner.activation_bytes(list(batch)))

    def _too_large(self, request: Any, need: int) -> ValueError:
        assert self.memory is not None
        subject = self.runner.describe_request(request)
        return ValueError(
            f"{subject} needs about {gib(need)} of activations on its own, more than this stage's memory "
            f"budget leaves for a batch ({self.memory.describe()}); ask for a smaller image"
        )

    # --- requests ----------------------------------------------------------------------------------

    def _resolve(self, request: Any) -> Any:
        """The request with a seed (drawn when it has none), its step caching over the stage's and its
        received parts joined (the runner's ``prepare``)."""
        if request.seed is None:
            request = msgspec.structs.replace(request, seed=self._seeds.randint(0, MAX_SEED))
        own, stage = request.cache, self.cache
        if own is not None or (stage is not None and stage.active):
            request = msgspec.structs.replace(request, cache=(own or StepCacheSpec()).over(stage).resolved())
        return self.runner.prepare(request)

    def _start_group(self, size: int, kind: str) -> DenoiserGroup:
        """Start the peers of a CFG- or sequence-parallel replica (``kind``; rank ``r`` on this replica's
        ``r``-th device; on CPU the ranks share the replica's threads) and route the runner's denoiser
        forwards through them."""
        import torch

        runner = self.runner
        field = f"{kind}_parallel_size"
        if not (runner.cfg_parallel if kind == "cfg" else runner.sequence_parallel):
            what = "CFG-parallel" if kind == "cfg" else "sequence-parallel"
            raise ValueError(f"{field}: {runner.label} cannot run {what}; remove it")
        plan = sequence_plan(runner.denoiser()) if kind == "sequence" else None
        if self.device.type == "cpu":
            threads = max(1, torch.get_num_threads() // size)
            torch.set_num_threads(threads)
            devices = ["cpu"] * size
        else:
            module = getattr(torch, self.device.type)
            first = self.device.index or 0
            if module.device_count() < first + size:
                raise ValueError(
                    f"{field} {size} needs {size} {self.device.type} devices from index {first}; "
                    f"this replica sees {module.device_count()} (give the stage {size} devices per replica)"
                )
            threads = None
            devices = [f"{self.device.type}:{first + rank}" for rank in range(size)]
        start = time.perf_counter()
        group = DenoiserGroup(size, [runner.peer_spec(self.model, d, threads) for d in devices[1:]])
        try:
            if plan is not None:
                self.context.parallel_denoiser = SequenceParallelDenoiser(
                    runner.denoiser(), group, plan, runner.step_joins()
                )
            else:
                self.context.parallel_denoiser = RowParallelDenoiser(
                    runner.denoiser(), group, runner.step_joins()
                )
        except BaseException:
            group.close()
            raise
        logger.info(
            "diffusion engine: %s over %d ranks (%s) ready in %.1f s",
            "CFG-parallel" if plan is None else "sequence-parallel",
            size,
            ", ".join(devices),
            time.perf_counter() - start,
        )
        return group

    def _check_compile(self) -> None:
        """Whether this runner on this device can compile its blocks (checked before anything starts)."""
        from vllm_omni_plugin.diffusion.compiled_blocks import compile_unavailable_reason

        if not self.runner.compiles_blocks:
            label = self.runner.label
            raise ValueError(f"{label} cannot compile its denoiser's blocks; remove the compile block")
        reason = compile_unavailable_reason(self.device)
        if reason is not None:
            raise ValueError(f"compile: {reason}; remove the compile block")

    def _compile(self, spec: CompileSpec) -> None:
        """Compile the blocks, then run the warm-up requests: each size as two guided requests (the
        denoiser's batch-symbolic graph) and one unguided (its batch-1 graph), so that no request compiles."""
        import torch

        from vllm_omni_plugin.diffusion.compiled_blocks import compile_count

        start, graphs = time.perf_counter(), compile_count()
        blocks = self.runner.compile_blocks(spec)
        sizes = spec.warmup_sizes or []
        for height, width in sizes:
            for count, guided in ((2, True), (1, False)):
                warm = self.runner.warmup_requests(height, width, count, guided=guided)
                batch = [self._resolve(r) for r in warm]
                generators = [torch.Generator("cpu").manual_seed(i) for i in range(count)]
                self.runner.run(batch, generators)
        self.compile_seconds = time.perf_counter() - start
        logger.info(
            "diffusion engine: compiled %d denoiser blocks (%s, %s shapes), warmed up at %s in %.1f s "
            "(%d graphs)",
            blocks,
            spec.mode or "default",
            spec.shapes or "dynamic",
            ", ".join(f"{h}x{w}" for h, w in sizes) or "no size (none known: set warmup_sizes)",
            self.compile_seconds,
            compile_count() - graphs,
        )

    def _cache_counted(self, computed: int, cached: int) -> None:
        with self._count_lock:
            self._counters.computed_blocks += computed
            self._counters.cached_blocks += cached

    @staticmethod
    def _failed(
        request: RunnerRequest, exc: BaseException, batch_size: int = 0, *, invalid: bool = False
    ) -> DiffusionResult:
        message = str(exc) if invalid else f"{type(exc).__name__}: {exc}"
        logger.warning("diffusion request %s failed: %s", request.request_id, message)
        return DiffusionResult(
            request_id=request.request_id,
            error=message,
            invalid=invalid,
            seed=request.seed,
            batch_size=batch_size,
        )

    @staticmethod
    def _aborted(request: RunnerRequest, batch_size: int) -> DiffusionResult:
        return DiffusionResult(
            request_id=request.request_id,
            error=ABORTED,
            aborted=True,
            seed=request.seed,
            batch_size=batch_size,
        )

    def plan(self, requests: Sequence[RunnerRequest]) -> tuple[list[list[int]], dict[int, DiffusionResult]]:
        """Batches of request indices (compatible, at most ``max_batch_size`` and ``max_step_tokens``,
        within the memory budget) and the requests that failed validation or fit no batch, by index.
        Batches keep request order within a key; keys in order of first appearance."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        failed: dict[int, DiffusionResult] = {}
        for index, request in enumerate(requests):
            try:
                if request.cache is not None and request.cache.active and not self.runner.step_cache:
                    raise ValueError(f"{self.runner.label} does not cache steps; leave cache unset")
                self.runner.validate(request)
                key = tuple(self.runner.batch_key(request))
                self._check_fits_alone(request)
            except Exception as exc:
                failed[index] = self._failed(request, exc, invalid=isinstance(exc, ValueError | TypeError))
                continue
            groups.setdefault(key, []).append(index)
        size = 1 if self.batch_invariant else self.max_batch_size
        batches = [chunk for indices in groups.values() for chunk in self._admitted(requests, indices, size)]
        return batches, failed

    def _check_fits_alone(self, request: Any) -> None:
        if self.memory is None:
            return
        need = self.activation_bytes([request])
        if need > self.memory.activation_bytes:
            raise self._too_large(request, need)

    def step_tokens(self, requests: Sequence[Any]) -> int:
        """Latent tokens a step of these requests carries (``max_step_tokens`` bounds it)."""
        return sum(int(self.runner.step_tokens(r)) for r in requests)

    def _admitted(self, requests: Sequence[Any], indices: list[int], size: int) -> Iterable[list[int]]:
        """``indices`` (one batch key) cut into batches of at most ``size`` requests and
        ``max_step_tokens`` tokens whose estimated activations fit the memory budget (a request larger
        than either runs alone: ``plan`` refused those that do not fit the memory budget alone)."""
        limit = self.memory.activation_bytes if self.memory is not None else None
        batch: list[int] = []
        tokens = 0
        for index in indices:
            need = int(self.runner.step_tokens(requests[index]))
            full = len(batch) == size or tokens + need > self.max_step_tokens
            if batch and limit is not None and not full:
                full = self.activation_bytes([requests[i] for i in (*batch, index)]) > limit
            if batch and full:
                yield batch
                batch, tokens = [], 0
            batch.append(index)
            tokens += need
        if batch:
            yield batch

    def generate(
        self, requests: Iterable[RunnerRequest], is_aborted: IsAborted | None = None
    ) -> list[DiffusionResult]:
        """One result per request, in request order; failures carry ``error`` instead of an image, aborted
        requests (``is_aborted``) ``aborted``."""
        resolved = [self._resolve(r) for r in requests]
        batches, results = self.plan(resolved)
        for batch in batches:
            requests_of_batch = [resolved[i] for i in batch]
            for index, result in zip(batch, self._run_batch(requests_of_batch, is_aborted), strict=True):
                results[index] = result
        return [results[i] for i in range(len(resolved))]

    # --- step batching -----------------------------------------------------------------------------

    def admit(
        self, requests: Iterable[RunnerRequest]
    ) -> tuple[list[list[RunnerRequest]], list[DiffusionResult]]:
        """The requests in the groups :meth:`run_group` takes (seeded, defaults filled, validated; one batch
        key, at most ``max_batch_size`` and ``max_step_tokens``, within the memory budget each), and the
        failures."""
        resolved = [self._resolve(r) for r in requests]
        batches, failed = self.plan(resolved)
        return [[resolved[i] for i in batch] for batch in batches], list(failed.values())

    def run_group(
        self,
        group: list[RunnerRequest],
        is_aborted: IsAborted | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> list[DiffusionResult]:
        """One admitted group (``batching: step``) as one pipeline call on the calling thread, its denoiser
        forwards shared with the other groups in flight; ``on_step`` after each of its steps. Results in
        group order, as :meth:`generate`'s."""
        if self.step_batcher is None:
            raise RuntimeError("run_group needs batching: step")
        return self._run_batch(group, is_aborted, on_step)

    def _group_steps(
        self, progress: _BatchProgress, on_step: Callable[[int], None] | None
    ) -> Callable[[int], None]:
        """A group's step callback: its requests count a step further (logged when it is time), then
        ``on_step``. Step times are the step batcher's (:meth:`_boundary_done`)."""

        def step_done(step: int) -> None:
            progress.steps = step + 1
            with self._count_lock:
                self._counters.denoise_steps += len(progress.batch)
            self._log_progress(progress, time.perf_counter())
            if on_step is not None:
                on_step(step)

        return step_done

    def count_loop_step(self, requests: int, seconds: float, preempted: int, parked: int) -> None:
        """``batching: loop`` ran a step of ``requests`` in ``seconds``, leaving ``preempted`` out and
        ``parked`` states parked in host memory (the loop reports it and holds at ``dit.step`` once the
        step's answers went out)."""
        with self._count_lock:
            counters = self._counters
            counters.denoise_steps += requests
            counters.steps += 1
            counters.step_requests += requests
            counters.step_seconds += seconds
            counters.preemptions += preempted
            counters.parked_states += parked

    def count_loop_finished(self, timings: list[dict[str, float]]) -> None:
        """``batching: loop`` finished these requests (each counts as a call: its wave's prompt
        encoding, its decoder call, its time from admission to its image)."""
        with self._count_lock:
            counters = self._counters
            for timing in timings:
                counters.decodes += 1
                counters.encode_seconds += timing["encode"]
                counters.decode_seconds += timing["decode"]
                counters.call_seconds += timing["total"]

    def _boundary_done(self, requests: int, seconds: float) -> None:
        """The step batcher ran a step boundary: ``requests`` in its forwards, which took ``seconds``."""
        with self._count_lock:
            counters = self._counters
            counters.steps += 1
            counters.step_requests += requests
            counters.step_seconds += seconds

    def request_steps(self) -> dict[str, tuple[int, int]]:
        """(steps done, steps in all) of each request the runner is working on (whole-request and step
        batching; the step loop's requests are its own); a request whose runner cannot tell its steps
        beforehand counts the steps done so far as all of them."""
        with self._count_lock:
            running = list(self._in_flight.values())
        steps_of = self.runner.steps_of
        return {r.request_id: (p.steps, max(p.steps, steps_of(r) or 0)) for p in running for r in p.batch}

    @property
    def denoise_steps(self) -> int:
        """Denoising steps run since load, counted per request (a step of a batch of B counts B)."""
        return self._counters.denoise_steps

    def counters(self) -> DiffusionCounters:
        """A copy of what ran since load (``/metrics``)."""
        with self._count_lock:
            return msgspec.structs.replace(self._counters)

    def count_started(self, waits: list[float]) -> None:
        """Requests taken from the queue after waiting these many seconds each."""
        with self._count_lock:
            self._counters.started += len(waits)
            self._counters.queue_wait_seconds += sum(waits)

    def close(self) -> None:
        """Stop the step and decode threads (``batching: step``), a CFG-parallel replica's peers and, where
        it compiled, inductor's compile workers."""
        for batcher in (self.step_batcher, self.decode_batcher):
            if batcher is not None:
                batcher.close()
        if self.parallel is not None:
            self.parallel.close()
        if self.compile is not None and self.compile.active:
            from vllm_omni_plugin.diffusion.compiled_blocks import release_compile_workers

            release_compile_workers()

    def _preview(self, request_id: str, index: int, image: Any) -> None:
        if self.on_preview is not None:
            self.on_preview(request_id, index, image)

    def _step_done(self, step: int) -> None:
        """The runner's step callback: count the batch's requests a step further; log when it is time."""
        progress = self._progress
        if progress is None:
            return
        progress.steps = step + 1
        now = time.perf_counter()
        with self._count_lock:
            counters = self._counters
            counters.denoise_steps += len(progress.batch)
            if step > 0:  # timed from the previous step's end (the first follows prompt encoding)
                counters.steps += 1
                counters.step_requests += len(progress.batch)
                counters.step_seconds += now - progress.last_step
        progress.last_step = now
        self._log_progress(progress, now)
        if self.on_progress is not None:
            self.on_progress()

    def _log_progress(self, progress: _BatchProgress, now: float) -> None:
        """A batch (or group) running longer than ``progress_interval_s`` logs its step every that long."""
        if now - max(progress.start, progress.last_log) >= self.progress_interval_s:
            progress.logged, progress.last_log = True, now
            total = self.runner.steps_of(progress.batch[0]) or progress.steps
            logger.info(
                "diffusion: step %d/%d of %d request(s) (%s), %.2f steps/s",
                progress.steps,
                total,
                len(progress.batch),
                progress.who,
                progress.steps / (now - progress.start),
            )

    def _left(self, progress: _BatchProgress) -> None:
        with self._count_lock:
            self._in_flight.pop(id(progress), None)

    def _finish_progress(self, progress: _BatchProgress) -> None:
        if progress.logged:
            logger.info(
                "diffusion: %d request(s) (%s) done: %d steps and decode in %.1f s",
                len(progress.batch),
                progress.who,
                progress.steps,
                time.perf_counter() - progress.start,
            )

    def _run_batch(
        self,
        batch: list[RunnerRequest],
        is_aborted: IsAborted | None,
        on_step: Callable[[int], None] | None = None,
    ) -> list[DiffusionResult]:
        import torch

        skipped = {r.request_id for r in batch if is_aborted(r.request_id)} if is_aborted else set()
        if skipped:  # aborted before their batch started: the others run without them
            live = [r for r in batch if r.request_id not in skipped]
            ran = {r.request_id: r for r in self._run_batch(live, is_aborted, on_step)} if live else {}
            return [ran.get(r.request_id) or self._aborted(r, 0) for r in batch]
        # CPU generators whatever the device: diffusers then draws the noise on the CPU and moves it, so a
        # seed gives the same image on every platform (up to kernel numerics).
        generators = [torch.Generator("cpu").manual_seed(int(r.seed or 0)) for r in batch]
        ids = [r.request_id for r in batch]
        stop = None if is_aborted is None else (lambda: all(is_aborted(i) for i in ids))
        batcher = self.step_batcher
        progress = _BatchProgress(batch, time.perf_counter())
        with self._count_lock:
            self._in_flight[id(progress)] = progress
        try:
            if batcher is None:
                self._progress = progress
                out = self.runner.run(batch, generators, should_stop=stop)
            else:
                count, group = self._group_steps(progress, on_step), " ".join(ids)
                if is_aborted is not None and len(ids) > 1:  # an aborted request's rows leave the forwards
                    batcher.track(group, lambda: [not is_aborted(i) for i in ids])
                out = self.runner.run_rows(batch, generators, stop, batcher, group, count)
        except BatchAborted as exc:
            self._progress = None
            self._left(progress)
            logger.info("diffusion batch of %d: every request aborted, %s", len(batch), exc)
            return [self._aborted(r, len(batch)) for r in batch]
        except Exception as exc:
            self._progress = None
            self._left(progress)
            if len(batch) > 1:  # find the culprit: the others must not fail with it
                logger.warning(
                    "diffusion batch of %d failed (%s: %s); retrying its requests one by one",
                    len(batch),
                    type(exc).__name__,
                    exc,
                )
                return [r for request in batch for r in self._run_batch([request], is_aborted, on_step)]
            return [self._failed(batch[0], exc, batch_size=1)]
        self._progress = None
        self._left(progress)
        self._finish_progress(progress)
        with self._count_lock:
            self._counters.decodes += 1
            self._counters.decode_seconds += out.timings.get("decode", 0.0)
            self._counters.encode_seconds += out.timings.get("encode", 0.0)
            self._counters.call_seconds += out.timings.get("total", 0.0)
        results = []
        for i, request in enumerate(batch):
            latents = out.latents[i] if out.latents is not None else None
            results.append(
                DiffusionResult(
                    request_id=request.request_id,
                    image=out.images[i],
                    latents=latents,
                    seed=request.seed,
                    batch_size=len(batch),
                    timings=dict(out.timings),
                )
            )
        return results


@dataclass
class _BatchProgress:
    """A batch the runner is working on (or a group, with step batching), for its step callback and
    progress log lines."""

    batch: list[RunnerRequest]
    start: float
    logged: bool = False
    last_log: float = 0.0
    last_step: float = 0.0
    steps: int = 0

    @property
    def who(self) -> str:
        ids = ", ".join(r.request_id for r in self.batch[:4])
        return ids + (f" and {len(self.batch) - 4} more" if len(self.batch) > 4 else "")


def _runner_class(path: str) -> type[DiffusionRunner]:
    """The runner class a pipeline names by dotted path (a clear error when it is none)."""
    runner = import_object(path)
    if not (isinstance(runner, type) and issubclass(runner, DiffusionRunner)):
        raise TypeError(f"{path} is not a DiffusionRunner subclass")
    return runner
