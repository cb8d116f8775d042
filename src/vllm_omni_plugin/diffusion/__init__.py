"""The diffusion (DiT) stage: runners (diffusers pipelines, or a family's own) behind one interface
(:class:`DiffusionRunner`), driven by inputs an AR stage computed or, as a stage of its own, by the user's
request. The runners live in their families (``families/``), named by dotted path; the registry of
diffusers classes -> runners is ``diffusers_registry``.

Imports stay lazy: ``import vllm_omni_plugin.diffusion`` pulls in neither torch nor diffusers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_omni_plugin.diffusion.params import DiffusionRequest, DiffusionResult

if TYPE_CHECKING:
    from vllm_omni_plugin.diffusion.diffusers_registry import (
        UnknownPipelineError,
        UnservablePipelineError,
        inspect_model,
        register_diffusion_pipeline,
    )
    from vllm_omni_plugin.diffusion.engine import DiffusionEngine
    from vllm_omni_plugin.diffusion.engine_config import DiffusionEngineConfig
    from vllm_omni_plugin.diffusion.runner import DiffusionRunner
    from vllm_omni_plugin.diffusion.worker import (
        CPUDiffusionWorker,
        CUDADiffusionWorker,
        DiffusionWorker,
    )

__all__ = [
    "CPUDiffusionWorker",
    "CUDADiffusionWorker",
    "DiffusionEngine",
    "DiffusionEngineConfig",
    "DiffusionRequest",
    "DiffusionResult",
    "DiffusionRunner",
    "DiffusionWorker",
    "UnknownPipelineError",
    "UnservablePipelineError",
    "inspect_model",
    "register_diffusion_pipeline",
]

_LAZY = {
    "DiffusionEngine": "engine",
    "DiffusionEngineConfig": "engine_config",
    "DiffusionRunner": "runner",
    "UnknownPipelineError": "diffusers_registry",
    "UnservablePipelineError": "diffusers_registry",
    "inspect_model": "diffusers_registry",
    "register_diffusion_pipeline": "diffusers_registry",
    "CPUDiffusionWorker": "worker",
    "CUDADiffusionWorker": "worker",
    "DiffusionWorker": "worker",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
