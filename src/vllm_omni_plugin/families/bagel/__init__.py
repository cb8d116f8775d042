"""BAGEL: the thinker (``models/bagel_thinker.py``) hands its context caches to our generation runner
(diffusers has no BAGEL pipeline). The package exports the DiT request types; the runner loads torch."""

from vllm_omni_plugin.families.bagel.request import (
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
        from vllm_omni_plugin.families.bagel.runner import BagelGenerationRunner

        return BagelGenerationRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
