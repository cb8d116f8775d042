"""The diffusers pipelines' request settings: none beyond OpenAI's fields and the generic diffusion ones
(steps, guidance, negative prompt, seed), which every pipeline takes."""

from __future__ import annotations

from vllm_omni_plugin.config.settings import RequestSettings


class DiffusersSettings(RequestSettings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass
