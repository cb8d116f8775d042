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
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from vllm_omni_plugin.diffusion.params import DiffusionRequest, DiffusionResult
from vllm_omni_plugin.diffusion.pipelines import BatchAborted, DiffusersPipelineRunner, load_pipeline_runner
from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

MAX_SEED = 2**63 - 1
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
    config's ``diffusion_args`` can be passed as is; registered runners need neither.
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
        self.runner = runner or load_pipeline_runner(self.model, dtype=self.dtype, device=self.device)
        self.load_seconds = time.perf_counter() - start
        runner_cls = type(self.runner)
        self.num_inference_steps = num_inference_steps or runner_cls.default_num_inference_steps
        self.guidance_scale = runner_cls.default_guidance_scale if guidance_scale is None else guidance_scale
        default_h, default_w = runner_cls.default_size or (None, None)
        self.height = height or default_h
        self.width = width or default_w
        self._seeds = random.Random(seed)
        if trust_remote_code:
            logger.debug("diffusion engine: trust_remote_code has no effect on registered pipeline runners")
        logger.info(
            "diffusion engine: %s (%s) on %s, %s, max_batch_size %d%s, load %.2f s",
            self.model,
            runner_cls.pipeline_class,
            self.device,
            self.dtype,
            max_batch_size,
            ", batch-invariant" if batch_invariant else "",
            self.load_seconds,
        )

    # --- requests ----------------------------------------------------------------------------------

    def _resolve(self, request: DiffusionRequest) -> DiffusionRequest:
        """The request with every default filled in (and a seed drawn when it has none)."""
        return msgspec.structs.replace(
            request,
            height=request.height or self.height,
            width=request.width or self.width,
            num_inference_steps=request.num_inference_steps or self.num_inference_steps,
            guidance_scale=self.guidance_scale if request.guidance_scale is None else request.guidance_scale,
            seed=self._seeds.randint(0, MAX_SEED) if request.seed is None else request.seed,
        )

    def _batch_key(self, request: DiffusionRequest) -> tuple[Any, ...]:
        common = (
            request.height,
            request.width,
            request.num_inference_steps,
            float(request.guidance_scale or 0.0),
            request.image_to_image,
        )
        return common + tuple(self.runner.batch_key(request))

    @staticmethod
    def _failed(request: DiffusionRequest, exc: BaseException, batch_size: int = 0) -> DiffusionResult:
        message = f"{type(exc).__name__}: {exc}"
        logger.warning("diffusion request %s failed: %s", request.request_id, message)
        return DiffusionResult(
            request_id=request.request_id, error=message, seed=request.seed, batch_size=batch_size
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
        """Batches of request indices (compatible, at most ``max_batch_size``) and the requests that failed
        validation, by index. Batches keep request order within a key; keys in order of first appearance."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        failed: dict[int, DiffusionResult] = {}
        for index, request in enumerate(requests):
            try:
                self.runner.validate(request)
                key = self._batch_key(request)
            except Exception as exc:
                failed[index] = self._failed(request, exc)
                continue
            groups.setdefault(key, []).append(index)
        size = 1 if self.batch_invariant else self.max_batch_size
        batches = [list(chunk) for indices in groups.values() for chunk in _chunks(indices, size)]
        return batches, failed

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
        ids = [r.request_id for r in batch]
        stop = None if is_aborted is None else (lambda: all(is_aborted(i) for i in ids))
        try:
            out = self.runner.run(batch, generators, should_stop=stop)
        except BatchAborted as exc:
            logger.info("diffusion batch of %d: every request aborted, %s", len(batch), exc)
            return [self._aborted(r, len(batch)) for r in batch]
        except Exception as exc:
            if len(batch) > 1:  # find the culprit: the others must not fail with it
                logger.warning(
                    "diffusion batch of %d failed (%s: %s); retrying its requests one by one",
                    len(batch),
                    type(exc).__name__,
                    exc,
                )
                return [result for request in batch for result in self._run_batch([request], is_aborted)]
            return [self._failed(batch[0], exc, batch_size=1)]
        results = []
        for i, request in enumerate(batch):
            latents = out.latents[i] if request.return_latents and out.latents is not None else None
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


def _chunks(items: list[int], size: int) -> Iterable[list[int]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk
