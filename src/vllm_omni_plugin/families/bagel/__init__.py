"""BAGEL's generation stage (stage 1): our runner, since diffusers has no BAGEL pipeline."""

from vllm_omni_plugin.diffusion.bagel.request import (
    EDIT_DEFAULTS,
    RENORM_TYPES,
    T2I_DEFAULTS,
    BagelContext,
    BagelGenerationRequest,
    BagelSampling,
)

__all__ = [
    "EDIT_DEFAULTS",
    "RENORM_TYPES",
    "T2I_DEFAULTS",
    "BagelContext",
    "BagelGenerationRequest",
    "BagelGenerationRunner",
    "BagelSampling",
]


def __getattr__(name: str) -> object:
    if name == "BagelGenerationRunner":  # torch only when the runner is wanted
        from vllm_omni_plugin.diffusion.bagel.runner import BagelGenerationRunner

        return BagelGenerationRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
