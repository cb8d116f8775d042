"""BAGEL's image transforms and token grids (the original ``ImageTransform``, ``patchify`` and position ids).

The thinker stage's processor resizes and normalises input images for the autoencoder and the ViT; the
generation stage needs the same size rules (an edit's output has the input's resized size) and the latent
grid. Resizing is PIL's bicubic, which is what the original's torchvision resize of a PIL image runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_omni_plugin.models.bagel.config import TransformConfig


def _divisible(value: float, stride: int) -> int:
    return max(stride, int(round(value / stride) * stride))


def _scaled(width: int, height: int, scale: float, stride: int) -> tuple[int, int]:
    return _divisible(round(width * scale), stride), _divisible(round(height * scale), stride)


def resized_size(width: int, height: int, spec: TransformConfig, image_count: int = 1) -> tuple[int, int]:
    """``(width, height)`` after the resize: the longest edge at most ``max_image_size``, the shortest at
    least ``min_image_size``, at most ``max_pixels / image_count`` pixels, both edges multiples of the stride
    (the original ``MaxLongEdgeMinShortEdgeResize``, rule for rule)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"an image of {width}x{height} pixels cannot be resized")
    scale = min(spec.max_image_size / max(width, height), 1.0)
    scale = max(scale, spec.min_image_size / min(width, height))
    new_w, new_h = _scaled(width, height, scale, spec.image_stride)
    if new_w * new_h > spec.max_pixels / image_count:
        scale = spec.max_pixels / image_count / (new_w * new_h)
        new_w, new_h = _scaled(new_w, new_h, scale, spec.image_stride)
    if max(new_w, new_h) > spec.max_image_size:
        scale = spec.max_image_size / max(new_w, new_h)
        new_w, new_h = _scaled(new_w, new_h, scale, spec.image_stride)
    return new_w, new_h


def to_rgb(image: Any) -> Any:
    """A PIL image in RGB; transparent pixels are composed onto white (the original ``pil_img2rgb``)."""
    import PIL.Image

    if image.mode == "RGBA" or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = PIL.Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.split()[3])
        return white
    return image.convert("RGB")


def as_pil(image: Any) -> Any:
    """PIL images pass; uint8 HxWx3 arrays become PIL images."""
    import PIL.Image

    if isinstance(image, PIL.Image.Image):
        return image
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] not in (3, 4):
        raise ValueError(f"images must be PIL images or uint8 HxWx3 arrays, got {array.dtype} {array.shape}")
    return PIL.Image.fromarray(array)


def resize(image: Any, spec: TransformConfig, image_count: int = 1) -> Any:
    import PIL.Image

    width, height = image.size
    new_w, new_h = resized_size(width, height, spec, image_count)
    return image.resize((new_w, new_h), PIL.Image.Resampling.BICUBIC)


def normalized_tensor(image: Any) -> torch.Tensor:
    """``[3, H, W]`` float32 in [-1, 1] (to-tensor, then mean 0.5 / std 0.5 as both original transforms)."""
    pixels = torch.from_numpy(np.array(to_rgb(image), dtype=np.uint8))
    return pixels.permute(2, 0, 1).float().div(255).sub(0.5).div(0.5)


class ImageTransform:
    """Resize then normalise: the original ``ImageTransform(max, min, stride)`` for the VAE or the ViT."""

    def __init__(self, spec: TransformConfig) -> None:
        self.spec = spec

    def size(self, width: int, height: int, image_count: int = 1) -> tuple[int, int]:
        return resized_size(width, height, self.spec, image_count)

    def resize(self, image: Any, image_count: int = 1) -> Any:
        return resize(to_rgb(as_pil(image)), self.spec, image_count)

    def __call__(self, image: Any, image_count: int = 1) -> torch.Tensor:
        return normalized_tensor(self.resize(image, image_count))


def patchify(image: torch.Tensor, patch: int) -> torch.Tensor:
    """``[C, H, W]`` -> ``[(H/p) * (W/p), p * p * C]``, patches row-major, each patch's values (p, q, c)."""
    channels, height, width = image.shape
    if height % patch or width % patch:
        raise ValueError(f"a {height}x{width} image does not split into {patch}x{patch} patches")
    grid = image.reshape(channels, height // patch, patch, width // patch, patch)
    return grid.permute(1, 3, 2, 4, 0).reshape(-1, patch * patch * channels)


def unpatchify(tokens: torch.Tensor, rows: int, cols: int, patch: int, channels: int) -> torch.Tensor:
    """Inverse of :func:`patchify`, batched: ``[B, rows * cols, p*p*C]`` -> ``[B, C, rows * p, cols * p]``."""
    batch = tokens.shape[0]
    grid = tokens.reshape(batch, rows, cols, patch, patch, channels)
    return grid.permute(0, 5, 1, 3, 2, 4).reshape(batch, channels, rows * patch, cols * patch)


def flattened_position_ids(
    height: int, width: int, patch: int, max_per_side: int, *, interpolate: bool = False
) -> torch.Tensor:
    """Row-major ids into a ``max_per_side``-wide 2-D position table for an image's patch grid.

    Extrapolate (BAGEL's default): ``row * max_per_side + col``. Interpolate: each patch's fractional
    coordinate is bucketed into the table's grid.
    """
    rows, cols = height // patch, width // patch
    if not interpolate:
        return (torch.arange(rows)[:, None] * max_per_side + torch.arange(cols)).flatten()
    boundaries = torch.arange(1 / max_per_side, 1.0, 1 / max_per_side)
    bucket_rows = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / rows), boundaries, right=True)
    bucket_cols = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / cols), boundaries, right=True)
    return (bucket_rows[:, None] * max_per_side + bucket_cols).flatten()
