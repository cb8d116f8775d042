"""BAGEL's image autoencoder: the FLUX.1 VAE, its encoder and decoder loadable on their own.

The thinker stage encodes input images (it loads only ``encoder.*`` from ``ae.safetensors``), the generation
stage decodes latents (only ``decoder.*``). Module names follow the checkpoint's (Black Forest Labs) naming so
its state dict loads as is. Encoding returns the posterior mean by default, so an input image always gives the
same context; ``generator=`` samples the posterior as the original does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni_plugin.models.bagel.config import BagelConfigError, VaeConfig
from vllm_omni_plugin.models.bagel.weights import CheckpointReader


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class _ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm1 = _group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.norm2 = _group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h


class _AttnBlock(nn.Module):
    """Single-head self-attention over all pixels of the lowest resolution."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = _group_norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        normed = self.norm(x)
        # [b, 1, h*w, c]: one head whose width is the channel count
        q, k, v = (proj(normed).flatten(2).transpose(1, 2).unsqueeze(1) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj_out(attended.squeeze(1).transpose(1, 2).reshape(b, c, h, w))


class _Downsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # pad right and bottom only, as FLUX does


class _Upsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _middle(channels: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1 = _ResnetBlock(channels, channels)
    mid.attn_1 = _AttnBlock(channels)
    mid.block_2 = _ResnetBlock(channels, channels)
    return mid


def _run_middle(mid: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return mid.block_2(mid.attn_1(mid.block_1(h)))


class FluxEncoder(nn.Module):
    """Image in [-1, 1] -> posterior moments (``2 * z_channels``) at 1/downsample resolution."""

    def __init__(self, cfg: VaeConfig) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(cfg.in_channels, cfg.ch, kernel_size=3, padding=1)
        self.down = nn.ModuleList()
        channels = cfg.ch
        last = len(cfg.ch_mult) - 1
        for level, mult in enumerate(cfg.ch_mult):
            stage = nn.Module()
            stage.block = nn.ModuleList()
            for _ in range(cfg.num_res_blocks):
                stage.block.append(_ResnetBlock(channels, cfg.ch * mult))
                channels = cfg.ch * mult
            if level != last:
                stage.downsample = _Downsample(channels)
            self.down.append(stage)
        self.mid = _middle(channels)
        self.norm_out = _group_norm(channels)
        self.conv_out = nn.Conv2d(channels, 2 * cfg.z_channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for stage in self.down:
            for block in stage.block:
                h = block(h)
            if hasattr(stage, "downsample"):
                h = stage.downsample(h)
        h = _run_middle(self.mid, h)
        return self.conv_out(F.silu(self.norm_out(h)))


class FluxDecoder(nn.Module):
    """Latents (``z_channels``, unscaled) -> image in about [-1, 1] at x downsample resolution."""

    def __init__(self, cfg: VaeConfig) -> None:
        super().__init__()
        channels = cfg.ch * cfg.ch_mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, channels, kernel_size=3, padding=1)
        self.mid = _middle(channels)
        stages: list[nn.Module] = []
        for level in reversed(range(len(cfg.ch_mult))):
            stage = nn.Module()
            stage.block = nn.ModuleList()
            for _ in range(cfg.num_res_blocks + 1):
                stage.block.append(_ResnetBlock(channels, cfg.ch * cfg.ch_mult[level]))
                channels = cfg.ch * cfg.ch_mult[level]
            if level != 0:
                stage.upsample = _Upsample(channels)
            stages.insert(0, stage)
        self.up = nn.ModuleList(stages)  # index = resolution level, 0 the finest (checkpoint order)
        self.norm_out = _group_norm(channels)
        self.conv_out = nn.Conv2d(channels, cfg.out_ch, kernel_size=3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = _run_middle(self.mid, self.conv_in(z))
        for stage in reversed(self.up):
            for block in stage.block:
                h = block(h)
            if hasattr(stage, "upsample"):
                h = stage.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VaeEncoder(nn.Module):
    """Images -> BAGEL latents: ``scale_factor * (z - shift_factor)``, z the posterior mean (or a sample)."""

    def __init__(self, cfg: VaeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = FluxEncoder(cfg)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``images``: ``[B, 3, H, W]`` normalised to [-1, 1]; returns ``[B, z, H/8, W/8]``."""
        mean, logvar = self.encoder(images).chunk(2, dim=1)
        z = mean
        if generator is not None:
            noise = torch.randn(mean.shape, generator=generator, device=generator.device, dtype=mean.dtype)
            z = mean + torch.exp(0.5 * logvar) * noise.to(mean.device)
        return self.cfg.scale_factor * (z - self.cfg.shift_factor)


class VaeDecoder(nn.Module):
    """BAGEL latents -> images in about [-1, 1]."""

    def __init__(self, cfg: VaeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.decoder = FluxDecoder(cfg)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``latents``: ``[B, z, h, w]``; returns ``[B, out_ch, h * 8, w * 8]``. The scale and shift are
        applied in float32, as BAGEL's authors do, before the latents meet the decoder's dtype."""
        dtype = next(self.decoder.parameters()).dtype
        return self.decoder((latents.float() / self.cfg.scale_factor + self.cfg.shift_factor).to(dtype))


def _load_half(module: nn.Module, part: str, reader: CheckpointReader, dtype: Any, device: Any) -> None:
    """Fill ``module.<part>`` from the ``<part>.*`` tensors, and nothing else, of the checkpoint."""
    target = getattr(module, part)
    expected = {f"{part}.{name}": value.shape for name, value in target.state_dict().items()}
    present = set(reader.with_prefix(f"{part}."))
    missing, unexpected = sorted(expected.keys() - present), sorted(present - expected.keys())
    if missing or unexpected:
        raise BagelConfigError(
            f"{reader.path}: its {part} does not match vae_config (missing {_few(missing)}, "
            f"unexpected {_few(unexpected)})"
        )
    state = {}
    for name, shape in sorted(expected.items()):
        found = reader.shape(name)
        if found != tuple(shape):
            raise BagelConfigError(
                f"{reader.path}: {name} has shape {found}; vae_config needs {tuple(shape)}"
            )
        state[name[len(part) + 1 :]] = reader.tensor(name, dtype=dtype, device=device)
    target.load_state_dict(state, strict=True, assign=True)


def _few(names: list[str]) -> str:
    return "[" + ", ".join(names[:4]) + (", ..." if len(names) > 4 else "") + "]"


def _load(
    cls: type[nn.Module],
    part: str,
    source: str | Path | CheckpointReader,
    cfg: VaeConfig,
    dtype: Any,
    device: Any,
) -> Any:
    with torch.device("meta"):
        module = cls(cfg)
    if isinstance(source, CheckpointReader):
        _load_half(module, part, source, dtype, device)
    else:
        with CheckpointReader(source) as reader:
            _load_half(module, part, reader, dtype, device)
    return module.eval()


def load_vae_encoder(
    source: str | Path | CheckpointReader, cfg: VaeConfig, *, dtype: Any, device: Any
) -> VaeEncoder:
    """Only ``encoder.*`` is read from ``ae.safetensors`` (a path, or an open reader)."""
    return _load(VaeEncoder, "encoder", source, cfg, dtype, device)


def load_vae_decoder(
    source: str | Path | CheckpointReader, cfg: VaeConfig, *, dtype: Any, device: Any
) -> VaeDecoder:
    """Only ``decoder.*`` is read from ``ae.safetensors`` (a path, or an open reader)."""
    return _load(VaeDecoder, "decoder", source, cfg, dtype, device)
