"""vLLM's real classes in this one process, as the engine scripts set them up (``from one_process import
...``: a script's own folder is on ``sys.path``).

Everything of vLLM is imported inside the functions: a script may need to import some of vLLM before the
rest (``glm_image_v2_positions.py`` records what happens before the CPU worker's shim is imported).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.interface import SchedulerInterface
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

S = TypeVar("S", bound="SchedulerInterface")
R = TypeVar("R", bound="GPUModelRunner")
TINY_ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "dtype": "float32",
    "max_model_len": 96,
    "block_size": 32,
    "kv_cache_memory_bytes": 1 << 20,
    "enable_prefix_caching": False,
}
"""A tiny model's engine: exact (fp32, eager) and small (96 tokens, a 1 MiB KV cache of 32-token blocks, no
prefix cache)."""


def engine_config(model: str, *, num_gpu_blocks: int | None = None, **engine_args: Any) -> VllmConfig:
    """The engine configuration of ``EngineArgs(model, **engine_args)``; ``num_gpu_blocks`` is what the KV
    cache size would give (no worker measures it here)."""
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=model, **engine_args).create_engine_config()
    if num_gpu_blocks is not None:
        config.cache_config.num_gpu_blocks = num_gpu_blocks
    return config


@contextlib.contextmanager
def one_process(config: VllmConfig) -> Iterator[None]:
    """``config`` current, and vLLM's distributed state for one CPU process (world size 1, gloo): what
    models, runners and layers built inside ask for."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:0", local_rank=0, backend="gloo"
        )
        ensure_model_parallel_initialized(1, 1)
        yield


def one_layer_kv_cache_config(config: VllmConfig, num_blocks: int = 16) -> KVCacheConfig:
    """A KV cache config of the tiny text model's first attention layer and no tensors: enough for a
    scheduler, which only counts blocks."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    block_size = config.cache_config.block_size
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn"],
                FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float32),
            )
        ],
    )


def no_kv_cache_config() -> KVCacheConfig:
    """A runner's KV cache config without groups: no attention backends are built (there is no KV cache),
    and an empty group list skips batch reordering."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[])


def make_scheduler(cls: type[S], config: VllmConfig, kv_cache_config: KVCacheConfig | None = None) -> S:
    """A scheduler of class ``cls`` as the engine core builds it; its KV cache config
    :func:`one_layer_kv_cache_config` unless given."""
    from vllm.v1.structured_output import StructuredOutputManager

    return cls(
        vllm_config=config,
        kv_cache_config=one_layer_kv_cache_config(config) if kv_cache_config is None else kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=config.cache_config.block_size,
    )


def loaded_runner(
    cls: type[R], config: VllmConfig, kv_cache_bytes: int | None = None
) -> tuple[R, KVCacheConfig]:
    """A model runner of class ``cls`` on the CPU with the model loaded, and its KV cache config.

    With ``kv_cache_bytes``, as vLLM's CPU worker makes it ready to run steps: the platform's kernels in
    place of Triton's registered first, then a real KV cache of that size in the layout vLLM resolves for
    the runner (``num_gpu_blocks`` set to its blocks). Without, :func:`no_kv_cache_config`: enough for a
    runner that only updates its state and computes positions."""
    import torch

    if kv_cache_bytes is None:
        runner = cls(config, torch.device("cpu"))
        runner.load_model()
        runner.kv_cache_config = no_kv_cache_config()
        return runner, runner.kv_cache_config

    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.utils import record_kv_cache_layout, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.worker.worker_base import WorkerBase

    current_platform.register_triton_kernel_overrides()  # what vLLM's CPU worker does at start-up
    runner = cls(config, torch.device("cpu"))
    runner.load_model()
    spec = runner.get_kv_cache_spec()
    layout = resolve_kv_cache_layout(
        config, [WorkerBase.get_supported_kv_cache_layouts(runner)], list(spec.values())
    )
    record_kv_cache_layout(config.cache_config, layout.name)
    kv_cache_config = get_kv_cache_configs(config, [spec], [kv_cache_bytes])[0]
    runner.initialize_kv_cache(kv_cache_config)
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return runner, kv_cache_config
