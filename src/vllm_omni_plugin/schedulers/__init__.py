"""Omni AR schedulers: one omni behaviour (a mixin) on vLLM's two scheduler bases.

Configuration resolution picks the variant from the final ``async_scheduling`` flag; these dotted paths
are what it writes into ``EngineArgs.scheduler_cls``.
"""

OMNI_AR_SCHEDULER = "vllm_omni_plugin.schedulers.omni_ar_scheduler.OmniARScheduler"
OMNI_AR_ASYNC_SCHEDULER = "vllm_omni_plugin.schedulers.omni_ar_scheduler.OmniARAsyncScheduler"
OMNI_AR_SCHEDULER_NAMES = frozenset({"OmniARScheduler", "OmniARAsyncScheduler"})


def is_omni_ar_scheduler(path: str) -> bool:
    """True for our scheduler family and vllm-omni's (legacy files pin it), under any module path."""
    module, _, name = path.replace(":", ".").rpartition(".")
    return name in OMNI_AR_SCHEDULER_NAMES and module.split(".")[0] in ("vllm_omni", "vllm_omni_plugin")
