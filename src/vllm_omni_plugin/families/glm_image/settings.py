"""GLM-Image's request settings: none beyond OpenAI's fields (its size, steps and guidance are those)."""

from __future__ import annotations

from vllm_omni_plugin.config.settings import RequestSettings


class GlmImageSettings(RequestSettings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass
