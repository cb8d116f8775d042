"""A denoiser's repeated blocks: what step caching counts (a cached step skips every one of them) and what
regional compilation compiles (one graph serves every block of a class)."""

from __future__ import annotations

from typing import Any


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
