"""``OmniARScheduler`` / ``OmniARAsyncScheduler``: the same omni behaviour on either vLLM base.

The omni behaviour itself (request metadata, stage outputs, the ``all_token_ids`` guarantee, trigger
hooks) is built by the AR-stage work in ``OmniARSchedulerMixin``; until then both classes schedule
exactly like their stock bases, which keeps them importable at their final dotted paths.
"""

from __future__ import annotations

from vllm_omni_plugin.compat import resolve

Scheduler = resolve("Scheduler")
AsyncScheduler = resolve("AsyncScheduler")


class OmniARSchedulerMixin:
    """Omni behaviour shared by both scheduler variants."""


class OmniARScheduler(OmniARSchedulerMixin, Scheduler):
    pass


class OmniARAsyncScheduler(OmniARSchedulerMixin, AsyncScheduler):
    pass
