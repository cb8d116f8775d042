"""``DiffusionEngineConfig``: everything a diffusion engine is configured with, in one checked object.

A diffusion stage's resolved ``diffusion_args`` (``config/diffusion_stage.py``) are this object's fields
plus what builds the worker (its class, threads and cores); benchmarks and tests build it directly.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from vllm_omni_plugin.diffusion.blocks import CompileSpec
from vllm_omni_plugin.diffusion.lora import MAX_LORAS
from vllm_omni_plugin.diffusion.memory import VaeTiling
from vllm_omni_plugin.diffusion.quantization import QuantizationSpec
from vllm_omni_plugin.diffusion.runner import MAX_BATCH_SIZE
from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec

BATCHING_MODES = ("request", "step", "loop")
"""``request``: a batch of whole requests runs all its steps and decodes before the next forms;
``step``: requests join and leave the running batch at step boundaries (:mod:`.step_batching`);
``loop``: one step loop over every admitted request (:mod:`.step_loop`)."""
BATCH_WAIT_MS = 100.0
"""The default ``batch_wait_ms``: long enough that requests arriving together start as one group (shorter
waits made groups of one under load), short enough to cost a request little."""
PROGRESS_INTERVAL_S = 10.0
"""How often a long batch logs its progress: short batches stay quiet, a minute-long one says so."""


class DiffusionEngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a :class:`~vllm_omni_plugin.diffusion.engine.DiffusionEngine` runs its pipeline."""

    dtype: str = "auto"
    """The weights' and activations' dtype (``"auto"``: float32 on CPU, bfloat16 elsewhere)."""
    max_batch_size: int = MAX_BATCH_SIZE
    """The most requests one batch (or one step-batching group) takes."""
    max_step_tokens: int | None = None
    """The most latent tokens a step carries over a batch's requests (None: the device type's default)."""
    seed: int | None = None
    """Seeds the draw of seeds for requests that bring none."""
    batch_invariant: bool = False
    """Every request in its own call: bit-exact reproducibility, at the cost of throughput."""
    runner_cls: str | None = None
    """The runner the pipeline names (its model is no diffusers pipeline); None: by ``model_index.json``."""
    progress_interval_s: float = PROGRESS_INTERVAL_S
    gpu_memory_utilization: float | None = None
    """The share of the device's memory (the machine's on CPU) the stage keeps to; None: no budget."""
    batching: Literal["request", "step", "loop"] | None = None
    """None: ``loop`` where the pipeline has step-loop pieces and requests may share steps (no
    ``batch_invariant``), else ``request``."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """``priority``: requests carry a priority (lower first, ties by arrival; vLLM's
    ``--scheduling-policy priority``) that orders the queue and, with ``batching: loop``, each step."""
    batch_wait_ms: float = BATCH_WAIT_MS
    """``batching: step``: how long a new request waits for others to start with it as one group."""
    overlap_decode: bool | None = None
    """``batching: loop``: finished requests decode beside the next steps (``step_loop.DecodeBeside``).
    None: on an accelerator, where the decoder's stream runs beside the steps' kernels; not on a CPU,
    whose cores the steps already use (a decoder thread there only takes them in turn: 0.74-0.99x the
    images/s at 32 clients and 1.6-5.8x the Poisson p99 of decoding between steps over three runs of
    ``benchmarks/diffusion_engine.py``)."""
    max_loras: int = MAX_LORAS
    cache: StepCacheSpec | None = None
    """Step caching (requests override it field by field); None: off."""
    compile: CompileSpec | None = None
    """Regional compilation of the denoiser's blocks; None: eager."""
    cfg_parallel_size: int = 1
    sequence_parallel_size: int = 1
    vae_tiling: VaeTiling = "auto"
    """When the VAE decodes image by image or tile by tile (``memory.VaeTiling``)."""
    quantization: QuantizationSpec | None = None
    """The denoiser's (and text encoders') weights quantized as they load; None: as stored."""

    def __post_init__(self) -> None:
        if self.batching is not None and self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)}, got {self.batching!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")
        if self.cfg_parallel_size > 1 and self.sequence_parallel_size > 1:
            raise ValueError("cfg_parallel_size and sequence_parallel_size cannot be combined; choose one")

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> DiffusionEngineConfig:
        """From a stage's ``diffusion_args`` (the worker's keys taken out); a key no field has is an error."""
        try:
            return msgspec.convert(args, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"diffusion engine arguments: {exc}") from exc
