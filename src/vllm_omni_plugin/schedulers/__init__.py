"""Omni AR schedulers: one omni behaviour (a mixin) on vLLM's two scheduler bases.

Configuration resolution picks the variant from the final ``async_scheduling`` flag; these dotted paths
are what it writes into ``EngineArgs.scheduler_cls``.
"""

OMNI_AR_SCHEDULER = "vllm_omni_plugin.schedulers.omni_ar_scheduler.OmniARScheduler"
OMNI_AR_ASYNC_SCHEDULER = "vllm_omni_plugin.schedulers.omni_ar_scheduler.OmniARAsyncScheduler"
