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
drops its image.

With a memory budget (``gpu_memory_utilization``, see :mod:`vllm_omni_plugin.diffusion.memory`), a batch
takes requests only while the runner's estimate of their activations fits what the budget leaves after
the weights; the others run in the next batch, and a request that does not fit alone fails as invalid.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from vllm_omni_plugin.diffusion.memory import (
    MemoryBudget,
    allocated_bytes,
    device_memory_bytes,
    gib,
    tensor_bytes,
)
from vllm_omni_plugin.diffusion.params import DiffusionRequest, DiffusionResult
from vllm_omni_plugin.diffusion.pipelines import BatchAborted, DiffusersPipelineRunner, load_pipeline_runner
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

MAX_SEED = 2**63 - 1
PROGRESS_INTERVAL_S = 10.0
"""How often a long batch logs its progress: short batches stay quiet, a minute-long one says so."""
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
    """Runs a diffusers pipeline (chosen by ``model_index.json``) on batches of :class:`DiffusionRequest`.

    ``num_inference_steps``, ``guidance_scale``, ``height``, ``width`` are defaults for requests that leave
    them unset (the pipeline runner's own defaults otherwise); ``seed`` seeds the draw of seeds for
    unseeded requests. ``trust_remote_code`` and ``enforce_eager`` are accepted so a resolved deploy
    config's ``diffusion_args`` can be passed as is; registered runners need neither. A batch that runs
    longer than ``progress_interval_s`` logs its requests' step progress every that many seconds.
    ``gpu_memory_utilization``: the share of the device's memory (the machine's on CPU) the stage keeps
    to; batches are formed within what it leaves after the weights (``memory``).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: Any = "auto",
        device: Any = "cpu",
        max_batch_size: int = 1,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        seed: int | None = None,
        batch_invariant: bool = False,
        trust_remote_code: bool = False,
        enforce_eager: bool = True,
        runner: DiffusersPipelineRunner | None = None,
        runner_cls: str | None = None,
        progress_interval_s: float = PROGRESS_INTERVAL_S,
        gpu_memory_utilization: float | None = None,
    ) -> None:
        import torch

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = str(model)
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self.batch_invariant = batch_invariant
        start = time.perf_counter()
        if runner is None and runner_cls:  # a runner the pipeline names (its model is no diffusers pipeline)
            runner = import_object(runner_cls).load(self.model, dtype=self.dtype, device=self.device)
        self.runner = runner or load_pipeline_runner(self.model, dtype=self.dtype, device=self.device)
        self.load_seconds = time.perf_counter() - start
        runner = self.runner
        self.memory: MemoryBudget | None = None
        """The stage's memory budget, its weights measured (None: no budget, batches by size only)."""
        if gpu_memory_utilization is not None:
            self.memory = self._measure_budget(gpu_memory_utilization)
        self.request_type: type = getattr(runner, "request_type", DiffusionRequest)
        """What this engine's runner takes (``DiffusionRequest`` for diffusers pipelines; BAGEL's runner
        has its own request type and fills its defaults itself)."""
        self.num_inference_steps = num_inference_steps or getattr(runner, "default_num_inference_steps", None)
        self.guidance_scale = (
            getattr(runner, "default_guidance_scale", None) if guidance_scale is None else guidance_scale
        )
        default_h, default_w = getattr(runner, "default_size", None) or (None, None)
        self.height = height or default_h
        self.width = width or default_w
        self._seeds = random.Random(seed)
        self.progress_interval_s = progress_interval_s
        self.denoise_steps = 0
        """Denoising steps run since load, counted per request (a step of a batch of B counts B)."""
        self.on_progress: Callable[[int], None] | None = None
        """Called with ``denoise_steps`` after every step (a stage process reports it to ``/metrics``)."""
        self._progress: _BatchProgress | None = None
        if hasattr(runner, "on_step"):
            runner.on_step = self._step_done
        if trust_remote_code:
            logger.debug("diffusion engine: trust_remote_code has no effect on registered pipeline runners")
        logger.info(
            "diffusion engine: %s (%s) on %s, %s, max_batch_size %d%s, load %.2f s",
            self.model,
            getattr(runner, "pipeline_class", type(runner).__name__),
            self.device,
            self.dtype,
            max_batch_size,
            ", batch-invariant" if batch_invariant else "",
            self.load_seconds,
        )

    def _measure_budget(self, fraction: float) -> MemoryBudget:
        """The budget with the weights as loaded: the allocator's count on CUDA, else the runner's
        tensors. A budget the weights leave nothing of is a start-up error, not a stage that refuses
        every request."""
        weights = allocated_bytes(self.device)
        if weights is None:
            holder = getattr(self.runner, "weight_tensors", None)
            weights = tensor_bytes(holder()) if holder is not None else 0
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
        if not hasattr(self.runner, "activation_bytes"):
            logger.warning(
                "diffusion engine: %s estimates no activation memory; batches are not bounded by the budget",
                type(self.runner).__name__,
            )
        logger.info("diffusion engine memory: %s", budget.describe())
        return budget

    def activation_bytes(self, batch: Sequence[Any]) -> int | None:
        """The runner's estimate of the activations of ``batch`` run as one call (None: it has none)."""
        estimate = getattr(self.runner, "activation_bytes", None)
        return None if estimate is None else int(estimate(list(batch)))

    def _too_large(self, request: Any, need: int) -> ValueError:
        assert self.memory is not None
        what = getattr(self.runner, "describe_request", None)
        subject = what(request) if what is not None else f"a {request.height}x{request.width} image"
        return ValueError(
            f"{subject} needs about {gib(need)} of activations on its own, more than this stage's memory "
            f"budget leaves for a batch ({self.memory.describe()}); ask for a smaller image"
        )

    # --- requests ----------------------------------------------------------------------------------

    def _resolve(self, request: Any) -> Any:
        """The request with every default filled in (and a seed drawn when it has none). A runner with
        its own request type fills its defaults itself (``prepare``)."""
        if not isinstance(request, DiffusionRequest):
            if request.seed is None:
                request = msgspec.structs.replace(request, seed=self._seeds.randint(0, MAX_SEED))
            prepare = getattr(self.runner, "prepare", None)
            return prepare(request) if prepare is not None else request
        return msgspec.structs.replace(
            request,
            height=request.height or self.height,
            width=request.width or self.width,
            num_inference_steps=request.num_inference_steps or self.num_inference_steps,
            guidance_scale=self.guidance_scale if request.guidance_scale is None else request.guidance_scale,
            seed=self._seeds.randint(0, MAX_SEED) if request.seed is None else request.seed,
        )

    def _batch_key(self, request: Any) -> tuple[Any, ...]:
        if not isinstance(request, DiffusionRequest):
            return tuple(self.runner.batch_key(request))
        common = (
            request.height,
            request.width,
            request.num_inference_steps,
            float(request.guidance_scale or 0.0),
            request.image_to_image,
        )
        return common + tuple(self.runner.batch_key(request))

    @staticmethod
    def _failed(
        request: DiffusionRequest, exc: BaseException, batch_size: int = 0, *, invalid: bool = False
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
    def _aborted(request: DiffusionRequest, batch_size: int) -> DiffusionResult:
        return DiffusionResult(
            request_id=request.request_id,
            error=ABORTED,
            aborted=True,
            seed=request.seed,
            batch_size=batch_size,
        )

    def plan(
        self, requests: Sequence[DiffusionRequest]
    ) -> tuple[list[list[int]], dict[int, DiffusionResult]]:
        """Batches of request indices (compatible, at most ``max_batch_size``, within the memory budget)
        and the requests that failed validation or fit no batch, by index. Batches keep request order
        within a key; keys in order of first appearance."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        failed: dict[int, DiffusionResult] = {}
        for index, request in enumerate(requests):
            try:
                self.runner.validate(request)
                key = self._batch_key(request)
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
        if need is not None and need > self.memory.activation_bytes:
            raise self._too_large(request, need)

    def _admitted(self, requests: Sequence[Any], indices: list[int], size: int) -> Iterable[list[int]]:
        """``indices`` (one batch key) cut into batches of at most ``size`` whose estimated activations
        fit the budget (each request fits alone: ``plan`` refused the others)."""
        if self.memory is None:
            yield from (list(chunk) for chunk in _chunks(indices, size))
            return
        limit = self.memory.activation_bytes
        batch: list[int] = []
        for index in indices:
            grown = [requests[i] for i in (*batch, index)]
            if batch and (len(batch) == size or (self.activation_bytes(grown) or 0) > limit):
                yield batch
                batch = []
            batch.append(index)
        if batch:
            yield batch

    def generate(
        self, requests: Iterable[DiffusionRequest], is_aborted: IsAborted | None = None
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

    def _step_done(self, step: int) -> None:
        """The runner's step callback: count the batch's requests a step further; log when it is time."""
        progress = self._progress
        if progress is None:
            return
        progress.steps = step + 1
        self.denoise_steps += len(progress.batch)
        now = time.perf_counter()
        if now - max(progress.start, progress.last_log) >= self.progress_interval_s:
            progress.logged, progress.last_log = True, now
            total = progress.batch[0].num_inference_steps or progress.steps
            logger.info(
                "diffusion: step %d/%d of %d request(s) (%s), %.2f steps/s",
                progress.steps,
                total,
                len(progress.batch),
                progress.who,
                progress.steps / (now - progress.start),
            )
        if self.on_progress is not None:
            self.on_progress(self.denoise_steps)

    def _finish_progress(self) -> None:
        progress, self._progress = self._progress, None
        if progress is not None and progress.logged:
            logger.info(
                "diffusion: %d request(s) (%s) done: %d steps and decode in %.1f s",
                len(progress.batch),
                progress.who,
                progress.steps,
                time.perf_counter() - progress.start,
            )

    def _run_batch(
        self, batch: list[DiffusionRequest], is_aborted: IsAborted | None
    ) -> list[DiffusionResult]:
        import torch

        skipped = {r.request_id for r in batch if is_aborted(r.request_id)} if is_aborted else set()
        if skipped:  # aborted before their batch started: the others run without them
            live = [r for r in batch if r.request_id not in skipped]
            ran = {result.request_id: result for result in self._run_batch(live, is_aborted)} if live else {}
            return [ran.get(r.request_id) or self._aborted(r, 0) for r in batch]
        # CPU generators whatever the device: diffusers then draws the noise on the CPU and moves it, so a
        # seed gives the same image on every platform (up to kernel numerics).
        generators = [torch.Generator("cpu").manual_seed(int(r.seed or 0)) for r in batch]
        self._progress = _BatchProgress(batch, time.perf_counter())
        ids = [r.request_id for r in batch]
        stop = None if is_aborted is None else (lambda: all(is_aborted(i) for i in ids))
        try:
            out = self.runner.run(batch, generators, should_stop=stop)
        except BatchAborted as exc:
            self._progress = None
            logger.info("diffusion batch of %d: every request aborted, %s", len(batch), exc)
            return [self._aborted(r, len(batch)) for r in batch]
        except Exception as exc:
            self._progress = None
            if len(batch) > 1:  # find the culprit: the others must not fail with it
                logger.warning(
                    "diffusion batch of %d failed (%s: %s); retrying its requests one by one",
                    len(batch),
                    type(exc).__name__,
                    exc,
                )
                return [result for request in batch for result in self._run_batch([request], is_aborted)]
            return [self._failed(batch[0], exc, batch_size=1)]
        self._finish_progress()
        results = []
        for i, request in enumerate(batch):
            wants_latents = getattr(request, "return_latents", False)
            latents = out.latents[i] if wants_latents and out.latents is not None else None
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
    """The batch the runner is working on, for the step callback (runs are one at a time)."""

    batch: list[DiffusionRequest]
    start: float
    logged: bool = False
    last_log: float = 0.0
    steps: int = 0

    @property
    def who(self) -> str:
        ids = ", ".join(r.request_id for r in self.batch[:4])
        return ids + (f" and {len(self.batch) - 4} more" if len(self.batch) > 4 else "")


def _chunks(items: list[int], size: int) -> Iterable[list[int]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk
