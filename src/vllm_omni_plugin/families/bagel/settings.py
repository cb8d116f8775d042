"""BAGEL's request settings: its guidance (``cfg_*``), schedule shift and think mode, which a request (top
level or ``extra_body``) and the DiT stage's ``default_sampling_params`` may set, over its authors' defaults
for the request's mode (:meth:`BagelSettings.with_defaults`). The processors read them complete."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Literal

import msgspec

from vllm_omni_plugin.config.settings import RequestSettings
from vllm_omni_plugin.families.bagel.request import EDIT_DEFAULTS, T2I_DEFAULTS

MAX_THINK_TOKENS = 1000
"""BAGEL's ``max_think_token_n``: the plan's tokens, its start token included."""


class BagelSettings(RequestSettings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    cfg_text_scale: float | None = None
    cfg_img_scale: float | None = None
    cfg_interval: tuple[float, float] | None = None
    cfg_renorm_type: Literal["global", "channel", "text_channel"] | None = None
    cfg_renorm_min: float | None = None
    timestep_shift: float | None = None
    think: bool | None = None
    """Let the thinker write its plan (or its reasoning, for a text answer) first."""
    max_think_tokens: int | None = None

    bounds: ClassVar[dict[str, dict[str, float]]] = {
        "cfg_text_scale": {"ge": 0.0, "le": 100.0},
        "cfg_img_scale": {"ge": 0.0, "le": 100.0},
        "cfg_renorm_min": {"ge": 0.0, "le": 1.0},
        "timestep_shift": {"gt": 0.0, "le": 100.0},
        "max_think_tokens": {"ge": 2, "le": 32768},
    }

    def with_defaults(self, *, edit: bool) -> BagelSettings:
        """Unset guidance and shift as BAGEL's authors set them per mode; no thinking; their plan length."""
        authors = msgspec.structs.asdict(EDIT_DEFAULTS if edit else T2I_DEFAULTS)
        own = {"think": False, "max_think_tokens": MAX_THINK_TOKENS}
        defaults = {name: own.get(name, authors.get(name)) for name in self.__struct_fields__}
        return msgspec.structs.replace(
            self, **{name: value for name, value in defaults.items() if getattr(self, name) is None}
        )

    def problems(self) -> Iterator[tuple[str | None, str]]:
        yield from super().problems()
        interval = self.cfg_interval
        if interval is not None and not 0.0 <= interval[0] <= interval[1] <= 1.0:
            yield None, f"cfg_interval must be [lo, hi] with 0 <= lo <= hi <= 1, got {list(interval)}"
