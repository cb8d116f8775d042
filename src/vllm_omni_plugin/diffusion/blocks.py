"""A denoiser's repeated blocks: what step caching counts (a cached step skips every one of them) and what
regional compilation compiles (one graph serves every block of a class)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
Shapes = Literal["dynamic", "automatic", "static"]
Side = Annotated[int, Meta(ge=1)]


class CompileSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A diffusion stage's ``compile`` block: regional ``torch.compile`` of its denoiser's repeated blocks
    (``diffusion/compiled_blocks.py``), compiled and warmed up at start-up."""

    blocks: bool | None = None
    """Compile the repeated blocks (default false: eager)."""
    mode: CompileMode | None = None
    """``torch.compile``'s mode (default ``default``)."""
    shapes: Shapes | None = None
    """``dynamic`` (default): graphs symbolic in the batch and image size from the first, so a block class
    compiles twice (batch 1, which Dynamo always specialises, and every other size); ``automatic``:
    ``torch.compile``'s own choice (a static graph first, symbolic ones after: up to five per class);
    ``static``: one graph per shape, up to Dynamo's recompile limit (then the block runs eagerly)."""
    warmup_sizes: list[tuple[Side, Side]] | None = None
    """``[height, width]`` pairs warmed up at start-up, each at a denoiser batch of 1 and of more (default:
    the stage's default size)."""

    @property
    def active(self) -> bool:
        return bool(self.blocks)

    @property
    def dynamic(self) -> bool | None:
        """``torch.compile``'s ``dynamic`` argument for :attr:`shapes`."""
        return {"dynamic": True, "automatic": None, "static": False}[self.shapes or "dynamic"]


def repeated_blocks(model: Any) -> list[Any]:
    """The transformer blocks of a diffusers denoiser, in order: the classes its ``_repeated_blocks``
    names (diffusers' own list for regional compilation), else the members of its module lists whose
    class names end in ``Block`` (SD3's ``transformer_blocks``, whose list diffusers leaves empty).
    Empty for a model with neither (a UNet's blocks differ level by level)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return []
    named = set(getattr(type(model), "_repeated_blocks", None) or ())
    if named:
        return [m for m in model.modules() if type(m).__name__ in named]
    blocks: list[Any] = []
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) > 0:
            if all(type(m).__name__.endswith("Block") for m in child):
                blocks.extend(child)
    return blocks
