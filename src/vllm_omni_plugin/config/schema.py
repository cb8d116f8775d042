"""The deploy config ("stages" form): strict msgspec structs.

Every field is optional at this level (``None`` = not set here), so the same structs describe a whole
file, a ``base_config`` parent, a ``platforms:`` section and ``--stage-overrides``; layers are merged
field by field and defaults are applied once, by resolution. Unknown and mistyped fields are errors.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from vllm_omni_plugin.diffusion.blocks import CompileSpec
from vllm_omni_plugin.diffusion.memory import VaeTiling
from vllm_omni_plugin.diffusion.quantization import QuantizationSpec
from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
Fraction = Annotated[float, Meta(gt=0.0, le=1.0)]
PositiveFloat = Annotated[float, Meta(gt=0.0)]
Port = Annotated[int, Meta(ge=1, le=65535)]
NonNegativeFloat = Annotated[float, Meta(ge=0.0)]
Backend = Literal["local", "ray"]
"""Where stage replicas run: processes on this host (``local``) or actors of a Ray cluster (``ray``)."""


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    pass


class ConnectorSpec(_Strict, frozen=True, kw_only=True):
    name: str
    """Connector class name, e.g. ``SharedMemoryConnector`` or ``NixlConnector``."""
    extra: dict[str, Any] = {}


class EdgeSpec(_Strict, frozen=True, kw_only=True):
    from_stage: int = msgspec.field(name="from")
    to: int | Literal["router"]
    """A stage id, or ``router``: the final stage's output on its way back to the API server."""
    window_size: int | None = None
    """Tokens per chunk handed over on this edge; -1 hands over the whole output at once."""
    max_inflight: PositiveInt | None = None
    """Requests in flight on this edge at once (back-pressure); None: bounded only by the stages."""
    same_node_connector: str | None = None
    """Backend ``ray``: the connector this edge uses instead of its own when both of its ends run on one
    Ray node (e.g. shared memory in place of NIXL)."""


class EngineCommon(_Strict, kw_only=True):
    """Engine fields that may be set pipeline-wide (top level) or per stage."""

    dtype: str | None = None
    trust_remote_code: bool | None = None
    enable_prefix_caching: bool | None = None
    seed: int | None = None
    engine_extras: dict[str, Any] | None = None
    """Further vLLM ``EngineArgs`` fields, checked against the installed vLLM."""


class StageDeployConfig(EngineCommon, kw_only=True):
    stage_id: int
    devices: str | None = None
    """Comma-separated device ids, e.g. ``"0"`` or ``"0,1"``."""
    num_replicas: PositiveInt | None = None
    process: bool | None = None
    """Run the stage in its own process (default) or, for diffusion stages, in the API process."""
    headless: bool | None = None
    """Run this stage's replicas in a headless worker (``vllm serve MODEL --omni --deploy-config F
    --stage-id N --headless --head HEAD_ADDR:PORT``, usually on another host) that registers with the
    head; the head runs the API server and the other stages and waits for the worker."""
    env: dict[str, str] | None = None
    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None
    max_model_len: PositiveInt | None = None
    gpu_memory_utilization: Fraction | None = None
    """The share of its device's memory the stage keeps to: an AR stage's vLLM engine (weights, KV cache,
    activations), a diffusion stage's process (capped there; batches are admitted by their estimated
    activations within what its weights leave). Stages placed on one GPU split it between them."""
    kv_cache_memory_bytes: NonNegativeInt | None = None
    enforce_eager: bool | None = None
    async_scheduling: bool | None = None
    tensor_parallel_size: PositiveInt | None = None
    allow_custom_scheduler: bool | None = None
    companion_timeout_s: PositiveFloat | None = None
    """AR stages of KV-handoff pipelines: seconds a request's other contexts (companion requests) may
    take once its main one is done, before the request fails naming the missing ones (default 30)."""
    input_connectors: dict[str, str] | None = None
    """Keyed ``from_stage_N``: the connector this stage reads stage N's output through."""
    output_connectors: dict[str, str] | None = None
    """Keyed ``to_stage_N`` or ``to_stage_router`` (the final output back to the API server)."""
    default_sampling_params: dict[str, Any] | None = None
    # diffusion knobs
    num_inference_steps: PositiveInt | None = None
    guidance_scale: Annotated[float, Meta(ge=0.0)] | None = None
    height: PositiveInt | None = None
    width: PositiveInt | None = None
    max_batch_size: PositiveInt | None = None
    """Diffusion stages: the most requests denoised together (a batch, or the requests in flight with
    ``batching: step``); unset: as many as ``max_step_tokens`` holds."""
    max_step_tokens: PositiveInt | None = None
    """Diffusion stages: the most latent tokens a denoising step carries, summed over the requests in it
    (each request: its image's tokens times its guidance branches); a request larger than this runs
    alone. Default by device: 1024 on CPU, 16384 on a GPU."""
    batching: Literal["request", "step", "loop"] | None = None
    """Diffusion stages: ``request`` batches whole requests; ``step`` lets requests join and
    leave the running batch at each denoising step (the requests in flight keep to ``max_step_tokens``
    and ``max_batch_size``); ``loop`` runs one step loop over every admitted request (at most
    ``max_batch_size``; SD3, FLUX and Qwen-Image text to image and unmasked edits, GLM-Image and
    BAGEL, other requests as whole ones between its steps). Unset: ``loop`` where the pipeline has
    step-loop pieces and ``batch_invariant`` is off, else ``request``."""
    scheduling_policy: Literal["fcfs", "priority"] | None = None
    """``priority`` lets requests carry a ``priority`` (lower first, ties by arrival, as vLLM's
    ``--scheduling-policy priority``). AR stages: vLLM's engine argument (the flag on the command line
    sets it): its scheduler takes waiting requests by priority. Diffusion stages: it orders the stage's
    queue and, with ``batching: loop``, each step, where a better request preempts worse ones between
    steps. Default ``fcfs``: a stage runs requests in arrival order, and where no stage has ``priority``
    a request with a priority other than 0 is refused (400)."""
    batch_wait_ms: NonNegativeFloat | None = None
    """Diffusion stages with ``batching: step``: while requests run, how long a new request waits for
    others to start with it (default 100)."""
    overlap_decode: bool | None = None
    """Diffusion stages with ``batching: loop``: finished requests decode on a thread of their own beside
    the next step, their answers sent after it (false: they decode after the step that finished them,
    before the next). Default: true on a GPU, where the decoder runs on a CUDA stream of its own; false on
    a CPU, where a decoder thread only takes the cores the steps use."""
    max_loras: PositiveInt | None = None
    """Diffusion stages: LoRA adapters each replica keeps loaded at once (default 4; the least recently
    used leaves first)."""
    cache: StepCacheSpec | None = None
    """Diffusion stages: step caching (``policy: fixed`` or ``threshold``, with their settings; off by
    default); a request's ``cache`` field overrides it field by field."""
    compile: CompileSpec | None = None
    """Diffusion stages: regional ``torch.compile`` of the denoiser's repeated blocks (``blocks: true``),
    compiled and warmed up at start-up (off by default)."""
    cfg_parallel_size: PositiveInt | None = None
    """Diffusion stages: the devices (processes) each replica spans, its denoiser forwards' rows cut over
    them: with batched guidance, each guidance branch on its own device (default 1)."""
    sequence_parallel_size: PositiveInt | None = None
    """Diffusion stages: the devices (processes) each replica spans, each computing its share of every
    denoiser forward's image tokens (SD3, FLUX, Qwen-Image, GLM-Image; default 1)."""
    vae_tiling: VaeTiling | None = None
    """Diffusion stages: ``auto`` (default) decodes a batch whole while its estimate fits the stage's memory
    budget (``gpu_memory_utilization``), else image by image, else in overlapping tiles (diffusers'
    ``enable_slicing`` / ``enable_tiling``, for that decode alone); ``always`` tiles every decode larger
    than a tile; ``never`` decodes whole."""
    quantization: str | QuantizationSpec | None = None
    """How the stage's weights are quantized. Diffusion stages: a torchao scheme for the denoiser
    (``int8_weight_only``, ``int8_dynamic``, ``float8_weight_only``, ``float8_dynamic``,
    ``int4_weight_only``), or a block with ``denoiser`` (a scheme, or ``gguf`` with ``gguf_file``) and
    ``text_encoders`` (``diffusion/quantization.py``). AR stages: vLLM's ``quantization`` engine argument
    (a method name, e.g. ``fp8``; a quantized checkpoint's own method is read from its config)."""
    num_threads: PositiveInt | None = None
    """Diffusion stages on CPU: the intra-op threads each replica runs, instead of the CPU threads
    policy's share of the cores (``config/cpu_threads.py``); the replica is then not bound to cores."""
    # placement on a Ray cluster (backend: ray), per replica
    num_cpus: NonNegativeFloat | None = None
    """CPUs Ray reserves for each replica (default 1)."""
    num_gpus: NonNegativeFloat | None = None
    """GPUs Ray reserves for each replica (default: the stage's devices on a GPU platform, 0 on CPU); more
    than one gives each replica a placement group on one node."""
    resources: dict[str, PositiveFloat] | None = None
    """Ray custom resources each replica needs, e.g. ``{dit_host: 1}`` for nodes started with
    ``ray start --resources '{"dit_host": 1}'``."""
    node_labels: dict[str, str] | None = None
    """Ray node labels a replica's node must carry, e.g. ``{gpu-kind: h100}`` for nodes started with
    ``ray start --labels gpu-kind=h100``."""
    max_restarts: Annotated[int, Meta(ge=-1)] | None = None
    """How often Ray restarts a replica's actor after it died (default -1: always)."""


class StageOverride(StageDeployConfig, kw_only=True):
    """``--stage-overrides`` entries: a stage's fields without the id (the key gives it)."""

    stage_id: int = -1


class HeadSpec(_Strict, kw_only=True):
    """Where the head accepts headless stage workers (they name it with ``--head ADDR:PORT``)."""

    host: str | None = None
    """Address the head binds for workers (default ``0.0.0.0``: every interface)."""
    port: Port | None = None
    """Default 29600."""
    heartbeat_interval_s: PositiveFloat | None = None
    """Default 1 s: how often head and workers tell each other they are alive."""
    heartbeat_timeout_s: PositiveFloat | None = None
    """Default 10 s: silence after which the head fails a worker's requests (HTTP 503) and waits for
    it to rejoin, and a worker shuts down because its head is gone."""


class RaySpec(_Strict, kw_only=True):
    """How the ``ray`` backend reaches its cluster and how long it waits for placements."""

    address: str | None = None
    """The Ray cluster (default: ``RAY_ADDRESS``, else the cluster ``ray start`` made on this host)."""
    namespace: str | None = None
    """Ray namespace of the stage actors (default ``vllm_omni``)."""
    placement_timeout_s: PositiveFloat | None = None
    """Default 120 s: how long start-up waits for every replica to get a place before it fails."""


class PlatformSection(_Strict, kw_only=True):
    stages: list[StageDeployConfig] = []


class DeployConfig(EngineCommon, kw_only=True):
    pipeline: str | None = None
    base_config: str | None = None
    """A deploy config this one extends: a packaged name (``glm_image.yaml``) or a path relative to
    this file."""
    async_chunk: bool | None = None
    backend: Backend | None = None
    """Where stage replicas run (default ``local``; ``ray``: actors on a running Ray cluster)."""
    ray: RaySpec | None = None
    max_retries: NonNegativeInt | None = None
    """Default 1: how many times a request interrupted by the death of a stage replica (before any of
    its output reached the client) runs again; past that it fails with HTTP 503."""
    connectors: dict[str, ConnectorSpec] = {}
    head: HeadSpec | None = None
    edges: list[EdgeSpec] = []
    stages: list[StageDeployConfig] = []
    platforms: dict[str, PlatformSection] = {}


# Stage fields that are vLLM EngineArgs of the same name (AR stages).
ENGINE_ARG_FIELDS: tuple[str, ...] = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "enforce_eager",
    "async_scheduling",
    "tensor_parallel_size",
    "dtype",
    "trust_remote_code",
    "enable_prefix_caching",
    "seed",
    "scheduling_policy",
)
AR_ONLY_FIELDS: frozenset[str] = frozenset(
    {
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "kv_cache_memory_bytes",
        "async_scheduling",
        "tensor_parallel_size",
        "enable_prefix_caching",
        "allow_custom_scheduler",
        "companion_timeout_s",
        "engine_extras",
    }
)
DIFFUSION_ONLY_FIELDS: frozenset[str] = frozenset(
    {
        "num_inference_steps",
        "guidance_scale",
        "height",
        "width",
        "max_batch_size",
        "max_step_tokens",
        "batching",
        "batch_wait_ms",
        "overlap_decode",
        "max_loras",
        "num_threads",
        "cache",
        "compile",
        "cfg_parallel_size",
        "sequence_parallel_size",
        "vae_tiling",
    }
)
RAY_RESOURCE_FIELDS: tuple[str, ...] = ("num_cpus", "num_gpus", "resources", "node_labels", "max_restarts")
"""Stage fields that say what each replica asks a Ray cluster for (backend ``ray`` only)."""
