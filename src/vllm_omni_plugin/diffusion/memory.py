"""A diffusion stage's memory budget, and what a batch of requests needs of it.

Stages that share a GPU (BAGEL's thinker and DiT, a one-GPU GLM-Image) each keep to a fraction of it,
``gpu_memory_utilization``, as vLLM's engines do. The diffusion stage's process is capped there
(``torch.cuda.set_per_process_memory_fraction``), its weights are measured once loaded, and what is left
(less a reserve for the allocator's fragmentation and the kernels' workspaces) is what one batch's
activations may take: the engine admits requests into a batch by the runner's estimate
(``activation_bytes``), so a batch never asks for more, and a request that cannot fit even alone fails
with an error naming its size and the budget (HTTP 400) instead of running out of memory.

On CPU the fraction is of the machine's memory, as vLLM's CPU backend reads it for the AR stage; the
stage admits requests against it the same way, but nothing caps what the process allocates.

The estimates are upper bounds of the peak, from the shapes alone (no run, no device): inference keeps
one block's activations at a time (no autograd), so a transformer's peak is one block's, not the sum over
its layers; the VAE decoder's is at full resolution. Their constants are stated where they are defined.
Attention is assumed to run in memory linear in the sequence (SDPA's flash or memory-efficient kernels,
which CUDA has for these shapes); a kernel that materialises the score matrix (CPU's math path with a
mask) needs more than estimated.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

GIB = 1 << 30
RESERVE_BYTES = 512 << 20
"""At least this much of a budget is kept back from activations: the caching allocator's fragmentation
(blocks it reserved but cannot hand out), cuBLAS/cuDNN workspaces, small tensors the estimates ignore."""
RESERVE_FRACTION = 0.05
"""... or this share of the budget, when that is more."""
BLOCK_HIDDEN_WIDTHS = 6
"""Live ``[tokens, hidden]`` tensors at a transformer block's peak: the residual stream, its normed and
modulated copy, Q, K, V (or the attention output) and the block output."""
BLOCK_FF_WIDTHS = 2
"""Live ``[tokens, ff_inner]`` tensors at the feed-forward's peak: the up projection and its activation
(a GEGLU's gate doubles the projection but halves the activation: counted as the same two)."""
DECODE_CHANNEL_WIDTHS = 6
"""Live ``[pixels, channels]`` tensors at a VAE decoder's peak, at full resolution with the channels of
its last upsampled level (the upsample's input and output, a resnet's norm, activation and convolution
outputs, the shortcut)."""


TILED_OUTPUT_WIDTHS = 6
"""Per pixel of a tiled decode, beside the tile in flight: the finished tiles' three channels and the
blended rows they are cut into (diffusers keeps both until the image is joined)."""
VaeTiling = Literal["auto", "always", "never"]
"""A stage's ``vae_tiling``: ``auto`` decodes a batch whole while its estimate fits the memory budget, else
image by image, else tile by tile; ``always`` tiles; ``never`` decodes whole (too large: refused)."""
DecodePlan = Literal["whole", "sliced", "tiled"]


def vae_tile_pixels(vae: Any) -> int:
    """Pixels of one tile the VAE decodes when tiling (its tile size; 512 x 512 where it names none)."""
    side = getattr(vae, "tile_sample_min_size", None)
    if isinstance(side, int):
        return side * side
    if isinstance(side, (tuple, list)):
        return int(side[0]) * int(side[-1])
    height = getattr(vae, "tile_sample_min_height", None) or 512
    width = getattr(vae, "tile_sample_min_width", None) or 512
    return int(height) * int(width)


def element_bytes(dtype: Any) -> int:
    """Bytes of one element of a ``torch.dtype`` (or its name)."""
    import torch

    if not isinstance(dtype, torch.dtype):
        dtype = getattr(torch, str(dtype).removeprefix("torch."))
    return int(dtype.itemsize)


def transformer_block_bytes(rows: int, tokens: int, hidden: int, ff_inner: int, element: int) -> int:
    """Peak activations of one transformer block over ``rows`` sequences of ``tokens`` tokens."""
    return rows * tokens * (BLOCK_HIDDEN_WIDTHS * hidden + BLOCK_FF_WIDTHS * ff_inner) * element


def vae_decode_bytes(images: int, pixels: int, channels: int, element: int) -> int:
    """Peak activations of decoding ``images`` images of ``pixels`` pixels each in one call (``channels``:
    the decoder's channels at full resolution)."""
    return images * pixels * DECODE_CHANNEL_WIDTHS * channels * element


def tensor_bytes(objects: Iterable[Any]) -> int:
    """Bytes of the distinct tensors in ``objects`` (modules' parameters and buffers, tensors), each
    storage counted once; a quantized weight (a torchao tensor subclass) by the tensors it holds (its
    int8 or float8 data and its scales), not by the shape it stands for."""
    import torch

    seen: set[tuple[Any, int]] = set()
    total = 0

    def add(tensor: torch.Tensor) -> None:
        nonlocal total
        inner = _inner_tensors(tensor)
        if inner is not None:
            for part in inner:
                add(part)
            return
        key = (tensor.device, tensor.data_ptr()) if tensor.device.type != "meta" else (None, id(tensor))
        if key in seen:
            return
        seen.add(key)
        total += tensor.numel() * tensor.element_size()

    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for tensor in (*obj.parameters(), *obj.buffers()):
                add(tensor)
        elif isinstance(obj, torch.Tensor):
            add(obj)
    return total


def logical_bytes(module: Any, element: int) -> int:
    """What ``module``'s floating-point parameters and buffers take at ``element`` bytes each, unquantized
    (a quantized weight counted at the shape it stands for; other tensors at their own size)."""

    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        quant_shape = getattr(tensor, "quant_shape", None)
        if quant_shape is not None:  # diffusers' GGUFParameter: bytes of GGUF blocks of this shape
            total += _numel(quant_shape) * element
        elif _inner_tensors(tensor) is not None or tensor.is_floating_point():
            total += tensor.numel() * element
        else:
            total += tensor.numel() * tensor.element_size()
    return total


def _inner_tensors(tensor: Any) -> list[Any] | None:
    """The tensors a wrapper tensor subclass holds (torchao's quantized weights), else None."""
    import torch

    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return None
    names, _ = tensor.__tensor_flatten__()
    return [getattr(tensor, name) for name in names]


def _numel(shape: Iterable[int]) -> int:
    total = 1
    for side in shape:
        total *= int(side)
    return total


def device_memory_bytes(device: Any) -> int:
    """The memory a budget is a fraction of: the GPU's (CUDA, ROCm), else the machine's."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(psutil.virtual_memory().total)


def allocated_bytes(device: Any) -> int | None:
    """What the caching allocator holds for tensors on ``device`` now (None off CUDA)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return None


def gib(size: int | float) -> str:
    return f"{size / GIB:.1f} GiB"


@dataclass(frozen=True)
class MemoryBudget:
    """A stage's budget and what its weights leave of it for activations."""

    fraction: float
    """``gpu_memory_utilization``."""
    device: str
    device_bytes: int
    weight_bytes: int

    @property
    def budget_bytes(self) -> int:
        return int(self.fraction * self.device_bytes)

    @property
    def reserve_bytes(self) -> int:
        return max(RESERVE_BYTES, int(RESERVE_FRACTION * self.budget_bytes))

    @property
    def activation_bytes(self) -> int:
        """What one batch's activations may take (negative: the weights alone exceed the budget)."""
        return self.budget_bytes - self.weight_bytes - self.reserve_bytes

    def describe(self) -> str:
        """``gpu_memory_utilization 0.4 of cuda:0's 79.1 GiB = 31.6 GiB, less 24.4 GiB of weights and
        1.6 GiB kept in reserve, leaves 5.6 GiB for a batch``."""
        return (
            f"gpu_memory_utilization {self.fraction:g} of {self.device}'s {gib(self.device_bytes)} = "
            f"{gib(self.budget_bytes)}, less {gib(self.weight_bytes)} of weights and "
            f"{gib(self.reserve_bytes)} kept in reserve, leaves {gib(max(0, self.activation_bytes))} "
            "for a batch"
        )
