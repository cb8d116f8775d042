"""What the BAGEL generation stage takes: a request's three context caches and its sampling settings.

Plain structs; tensor fields are typed ``Any`` and hold ``torch.Tensor`` objects in process (whoever moves a
request between processes encodes them, as for :class:`~vllm_omni_plugin.diffusion.params.DiffusionRequest`).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from vllm_omni_plugin.diffusion.params import RunnerRequest

RenormType = Literal["global", "channel", "text_channel"]
RENORM_TYPES: tuple[str, ...] = ("global", "channel", "text_channel")


class BagelContext(msgspec.Struct, kw_only=True):
    """One request's context cache as the thinker stage built it (BAGEL's ``NaiveCache`` content)."""

    kv: Any = None
    """``torch.Tensor [num_layers, 2, kv_len, num_kv_heads, head_dim]``: index 0 keys (after QK-norm and
    RoPE, as BAGEL caches them), 1 values. ``None`` (or an empty tensor) when ``kv_len`` is 0."""
    kv_len: int = 0
    rope: int = 0
    """The next RoPE position: the whole generated image block sits at this position."""
    prefix_of: str | None = None
    """``"cond"``: this context is the first ``kv_len`` tokens of the request's ``cond`` context (an
    edit's image-only context, or text-to-image's ``cfg_img``, which is ``cond`` itself); no tensor
    travels for it. The runner's ``prepare`` makes it a view of ``cond``."""

    @classmethod
    def empty(cls) -> BagelContext:
        """No context at all: text-to-image's ``cfg_text`` branch."""
        return cls(kv=None, kv_len=0, rope=0)


class BagelSampling(msgspec.Struct, frozen=True, kw_only=True):
    """BAGEL's generation settings; :data:`T2I_DEFAULTS` and :data:`EDIT_DEFAULTS` are its authors' values."""

    num_inference_steps: int = 50
    """Points of the schedule; the flow runs ``num_inference_steps - 1`` steps."""
    timestep_shift: float = 3.0
    """``t' = s * t / (1 + (s - 1) * t)``: above 1 spends more steps at high noise."""
    cfg_text_scale: float = 4.0
    """Guidance against the context without the text; 1 (or less) turns guidance off altogether."""
    cfg_img_scale: float = 1.0
    """Guidance against the context without the input image; applies only above 1 (and with text guidance)."""
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    """Guidance runs at steps whose shifted time has ``lo < t <= hi``; others run the full context only."""
    cfg_renorm_type: RenormType = "global"
    """``global``: rescale the guided velocity to at most the conditional one's norm over the whole image;
    ``channel``: per token; ``text_channel``: per token, after the text guidance only."""
    cfg_renorm_min: float = 0.0
    """Lower bound of that rescale factor (its upper bound is 1)."""


T2I_DEFAULTS = BagelSampling(
    num_inference_steps=50,
    timestep_shift=3.0,
    cfg_text_scale=4.0,
    cfg_img_scale=1.0,
    cfg_interval=(0.4, 1.0),
    cfg_renorm_type="global",
    cfg_renorm_min=0.0,
)
"""Text to image, as BAGEL's authors recommend it."""

EDIT_DEFAULTS = BagelSampling(
    num_inference_steps=50,
    timestep_shift=3.0,
    cfg_text_scale=4.0,
    cfg_img_scale=2.0,
    cfg_interval=(0.0, 1.0),
    cfg_renorm_type="text_channel",
    cfg_renorm_min=0.0,
)
"""Image editing, as BAGEL's authors recommend it (they suggest ``global`` renorm if results look blurry)."""


class BagelGenerationRequest(RunnerRequest, kw_only=True, tag="bagel"):
    """One image for BAGEL's generation stage (``seed``, for the record: the noise comes from the
    generator handed to ``run`` with the request)."""

    cond: BagelContext
    """The full context (text, and for an edit the input image's VAE and ViT blocks)."""
    cfg_text: BagelContext | None = None
    """The context without the text: empty for text-to-image, the image blocks for an edit. Needed when
    ``cfg_text_scale > 1``."""
    cfg_img: BagelContext | None = None
    """The context without the image (the text only; text-to-image: the same as ``cond``). Needed when both
    scales are above 1."""
    height: int
    width: int
    sampling: BagelSampling
