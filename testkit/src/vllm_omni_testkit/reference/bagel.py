"""An independent, single-process PyTorch implementation of BAGEL inference: the oracle for BAGEL tests.

Written from the published method and the semantics of the authors' code (``inferencer.py``,
``modeling/bagel/{bagel,qwen2_navit,siglip_navit,modeling_utils}.py``, ``modeling/autoencoder.py``,
``data/{transforms,data_utils}.py``); it shares no model code with the plugin's stages. Batch 1, plain
PyTorch (explicit softmax attention), fp32 by default, no flash-attn, no vLLM, no diffusers models.

It follows the original exactly except for the spec's deliberate deviations: the VAE encoder returns the
posterior mean (``sample_posterior=True`` gives the original's sampling), no bf16 casts inside attention,
the initial noise comes from ``torch.Generator("cpu").manual_seed(seed)``, and the image-transform sizes
and autoencoder parameters are read from ``config.json`` (``vae_transform``, ``vit_transform``,
``vae_config``) with the original's values as defaults.

In a lower precision (``dtype=torch.bfloat16``) it computes as the original does with bf16 weights under
autocast: weights and activations in that dtype, but the flow state in fp32 (the noise is drawn in fp32 and
``x_t - v_t * dt`` promotes to fp32) and the decoder's latent affine in fp32, cast at its first convolution.
A flow state kept in bf16 would lose most of each small step's update (a 50-step latent drifts 4x further
from fp32 than the original's).

API::

    ref = BagelReference(model_dir, dtype=torch.float32)
    ctx = ref.new_context()                                  # empty: kv_len 0, rope 0
    ctx = ref.add_text(ctx, "a red fox")                     # [<|im_start|>] + ids + [<|im_end|>], causal
    ctx = ref.add_image(ctx, pil, vae=True, vit=True)        # VAE block, then ViT block (one rope each)
    ctx.kv() -> Tensor[L, 2, kv_len, kv_heads, head_dim]; ctx.kv_len; ctx.rope; ctx.segments
    ref.context_from_kv(kv_or_None, rope)                    # a context computed elsewhere (stage 0)
    ids = ref.generate_text(ctx, max_new_tokens=16)          # ids after <|im_start|>, <|im_end|> excluded
    latent = ref.generate_latent(cond, cfg_text, cfg_img, height=64, width=64, seed=0, ...)
    img = ref.generate_image(cond, cfg_text, cfg_img, height=64, width=64, seed=0, ...)  # uint8 HxWx3
    out = ref.interleave([image, "make it blue"], think=False, understanding=False, ...)

Contexts are immutable: every ``add_*`` returns a new context, so the original's ``deepcopy`` bookkeeping
(``cfg_text`` = the context before the text, ``cfg_img`` = the context without images) is plain sharing.

Generation parameters keep the original's semantics; two are renamed to match the plugin's request
fields: ``num_inference_steps`` (the original's ``num_timesteps``) and ``height``/``width`` (its
``image_shapes``). ``generate_text(max_new_tokens=N)`` returns at most N tokens, which is the original's
``generate_text(max_length=N + 1)`` (its count includes the start token); ``interleave`` maps
``max_think_token_n`` the original's way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

VLM_THINK_SYSTEM_PROMPT = (
    "You should first think about the reasoning process in the mind and then provide the user with the "
    "answer. \nThe reasoning process is enclosed within <think> </think> tags, i.e. <think> reasoning "
    "process here </think> answer here"
)
GEN_THINK_SYSTEM_PROMPT = (
    "You should first think about the planning process in the mind and then generate the image. \nThe "
    "planning process is enclosed within <think> </think> tags, i.e. <think> planning process here "
    "</think> image here"
)

DEFAULT_VAE_TRANSFORM = {"max_image_size": 1024, "min_image_size": 512, "image_stride": 16}
DEFAULT_VIT_TRANSFORM = {"max_image_size": 980, "min_image_size": 224, "image_stride": 14}
DEFAULT_VAE_CONFIG = {
    "resolution": 256,
    "in_channels": 3,
    "downsample": 8,
    "ch": 128,
    "out_ch": 3,
    "ch_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "z_channels": 16,
    "scale_factor": 0.3611,
    "shift_factor": 0.1159,
}
CFG_RENORM_TYPES = ("global", "channel", "text_channel")


# --- image transforms (data/transforms.py, data/data_utils.py) ------------------------------------------


def pil_to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with transparent images composited on white (the original's ``pil_img2rgb``)."""
    if image.mode == "RGBA" or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = Image.new(mode="RGB", size=image.size, color=(255, 255, 255))
        white.paste(image, mask=image.split()[3])
        return white
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageTransform:
    """The original's ``ImageTransform(max, min, stride)``: aspect-preserving bicubic resize so the long edge
    is at most ``max_image_size``, the short edge at least ``min_image_size``, both multiples of
    ``image_stride`` and the area at most ``max_pixels``; then ``[-1, 1]`` CHW float32."""

    max_image_size: int
    min_image_size: int
    image_stride: int
    max_pixels: int = 14 * 14 * 9 * 1024

    def _divisible(self, value: float) -> int:
        return max(self.image_stride, int(round(value / self.image_stride) * self.image_stride))

    def _scaled(self, width: int, height: int, scale: float) -> tuple[int, int]:
        return self._divisible(round(width * scale)), self._divisible(round(height * scale))

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """``(new_width, new_height)`` for an image of ``width`` x ``height``."""
        scale = min(self.max_image_size / max(width, height), 1.0)
        scale = max(scale, self.min_image_size / min(width, height))
        new_width, new_height = self._scaled(width, height, scale)
        if new_width * new_height > self.max_pixels:
            scale = self.max_pixels / (new_width * new_height)
            new_width, new_height = self._scaled(new_width, new_height, scale)
        if max(new_width, new_height) > self.max_image_size:
            scale = self.max_image_size / max(new_width, new_height)
            new_width, new_height = self._scaled(new_width, new_height, scale)
        return new_width, new_height

    def resize(self, image: Image.Image) -> Image.Image:
        size = self.target_size(*image.size)
        return image if size == image.size else image.resize(size, Image.BICUBIC)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        array = np.array(self.resize(image), dtype=np.uint8, copy=True)
        tensor = torch.from_numpy(array).permute(2, 0, 1).contiguous().to(torch.float32).div(255)
        return tensor.sub_(0.5).div_(0.5)


def patchify(image: torch.Tensor, patch: int) -> torch.Tensor:
    """``[C, H, W]`` -> ``[(H/p) * (W/p), p * p * C]``, features in (p, q, c) order."""
    c, h, w = image.shape
    image = image.reshape(c, h // patch, patch, w // patch, patch)
    return torch.einsum("chpwq->hwpqc", image).reshape(-1, patch * patch * c)


def flattened_position_ids(height: int, width: int, patch: int, max_per_side: int) -> torch.Tensor:
    """Row-major 2-D grid ids ``row * max_per_side + col`` (the original's "extrapolate" mode)."""
    rows = torch.arange(0, height // patch)
    cols = torch.arange(0, width // patch)
    return (rows[:, None] * max_per_side + cols).flatten()


# --- contexts ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BagelContext:
    """One request's KV cache (the original's ``NaiveCache`` plus ``kv_lens``/``ropes``), immutable.

    ``keys``/``values``: one ``[kv_len, kv_heads, head_dim]`` tensor per layer (keys after QK-norm and
    RoPE). ``rope``: the next RoPE position. ``segments``: ``(kind, start, length, position)`` per block,
    kind ``text`` / ``vae`` / ``vit`` / ``kv`` (imported).
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    rope: int
    segments: tuple[tuple[str, int, int, int], ...] = field(default=())

    @property
    def kv_len(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def kv(self) -> torch.Tensor:
        """``[num_layers, 2, kv_len, kv_heads, head_dim]`` (0 = keys, 1 = values), the handoff layout."""
        return torch.stack([torch.stack([k, v]) for k, v in zip(self.keys, self.values, strict=True)])

    @classmethod
    def from_kv(cls, kv: torch.Tensor, rope: int) -> BagelContext:
        """A context from the handoff layout (e.g. what stage 0 exported)."""
        if kv.ndim != 5 or kv.shape[1] != 2:
            raise ValueError(f"kv must be [num_layers, 2, kv_len, kv_heads, head_dim], got {tuple(kv.shape)}")
        segments = (("kv", 0, int(kv.shape[2]), 0),) if kv.shape[2] else ()
        return cls(tuple(kv[:, 0].unbind(0)), tuple(kv[:, 1].unbind(0)), int(rope), segments)

    def _extended(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], kind: str, rope: int
    ) -> BagelContext:
        start, length = self.kv_len, int(keys[0].shape[0])
        return BagelContext(
            tuple(torch.cat([old, new]) for old, new in zip(self.keys, keys, strict=True)),
            tuple(torch.cat([old, new]) for old, new in zip(self.values, values, strict=True)),
            rope,
            (*self.segments, (kind, start, length, self.rope)),
        )


@dataclass
class InterleaveResult:
    """What ``interleave`` produced and the contexts it used (the original's return list is ``outputs``)."""

    outputs: list[Any]
    text: str | None
    text_ids: list[int] | None
    image: np.ndarray | None
    height: int | None
    width: int | None
    cond: BagelContext
    cfg_text: BagelContext
    cfg_img: BagelContext


# --- the model ------------------------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


class BagelReference:
    """BAGEL-7B-MoT inference from a model directory in the hub layout (see the module docstring)."""

    def __init__(
        self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> None:
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        self.dtype, self.device = dtype, torch.device(device)
        config = json.loads((self.model_dir / "config.json").read_text())
        llm = config.get("llm_config") or json.loads((self.model_dir / "llm_config.json").read_text())
        vit = config.get("vit_config") or json.loads((self.model_dir / "vit_config.json").read_text())
        self.config = config

        # Language model (the original's loader forces qk_norm, untied embeddings and MoT layers).
        self.hidden = int(llm["hidden_size"])
        self.num_layers = int(llm["num_hidden_layers"])
        self.num_heads = int(llm["num_attention_heads"])
        self.num_kv_heads = int(llm["num_key_value_heads"])
        self.head_dim = self.hidden // self.num_heads
        self.eps = float(llm["rms_norm_eps"])
        theta = float(llm.get("rope_theta") or (llm.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        self.inv_freq = (1.0 / (theta**exponent)).to(self.device)

        # Vision encoder: the checkpoint holds num_hidden_layers - 1 layers, and the original runs those.
        self.vit_layers = int(vit["num_hidden_layers"]) - 1
        self.vit_heads = int(vit["num_attention_heads"])
        self.vit_patch = int(vit["patch_size"])
        self.vit_eps = float(vit.get("layer_norm_eps", 1e-6))
        self.vit_max_per_side = int(config.get("vit_max_num_patch_per_side", 70))

        # Generation: latent tokens are 2x2 patches of the VAE latent.
        vae = {**DEFAULT_VAE_CONFIG, **(config.get("vae_config") or {})}
        self.vae_config = vae
        self.latent_patch = int(config.get("latent_patch_size", 2))
        self.latent_channels = int(vae["z_channels"])
        self.latent_downsample = int(vae["downsample"]) * self.latent_patch
        if config.get("interpolate_pos", False):
            raise ValueError("interpolate_pos=true is not implemented (BAGEL-7B-MoT uses extrapolation)")

        self.vae_transform = ImageTransform(
            **{**DEFAULT_VAE_TRANSFORM, **(config.get("vae_transform") or {})}
        )
        self.vit_transform = ImageTransform(
            **{**DEFAULT_VIT_TRANSFORM, **(config.get("vit_transform") or {})}
        )

        def load(name: str) -> dict[str, torch.Tensor]:
            tensors = load_file(str(self.model_dir / name))
            return {k: v.to(device=self.device, dtype=dtype) for k, v in tensors.items()}

        self.w = load("ema.safetensors")
        self.ae = load("ae.safetensors")
        # max_latent_size is the side of the latent position table: the hub's config.json says 32 while
        # BAGEL-7B-MoT's table is 64 x 64, the value the original app passes when it builds the model.
        self.max_latent_size = math.isqrt(int(self.w["latent_pos_embed.pos_embed"].shape[0]))
        for i in range(self.vit_layers):
            if f"vit_model.vision_model.encoder.layers.{i}.layer_norm1.weight" not in self.w:
                raise ValueError(f"the checkpoint lacks ViT layer {i} (config: {self.vit_layers + 1} layers)")

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        ids = self.tokenizer.convert_tokens_to_ids(
            ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
        )
        self.bos_id, self.eos_id, self.start_of_image_id, self.end_of_image_id = (int(i) for i in ids)

    # -- building blocks ---------------------------------------------------------------------------------

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _routed(self, x: torch.Tensor, gen: torch.Tensor | None, fn: Any, und: str, gen_name: str) -> Any:
        """``fn(rows, name)`` with the und weights on und rows and the ``_moe_gen`` weights on gen rows."""
        if gen is None or not bool(gen.any()):
            return fn(x, und)
        out_und = fn(x[~gen], und)
        out_gen = fn(x[gen], gen_name)
        out = out_und.new_empty((x.shape[0], *out_und.shape[1:]))
        out[~gen] = out_und
        out[gen] = out_gen
        return out

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return _rms_norm(x, self.w[f"{name}.weight"], self.eps)

    def _mlp(self, x: torch.Tensor, name: str) -> torch.Tensor:
        gate = F.silu(self._linear(x, f"{name}.gate_proj"))
        return self._linear(gate * self._linear(x, f"{name}.up_proj"), f"{name}.down_proj")

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        return x * cos + _rotate_half(x) * sin

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        """q ``[n, H, d]`` over k/v ``[m, Hkv, d]`` (the last n keys are the queries' own); causal masks
        bottom-right aligned, as flash-attn's varlen kernel does."""
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q, k) * (1.0 / math.sqrt(self.head_dim))
        if causal:
            n, m = q.shape[0], k.shape[0]
            allowed = torch.arange(m)[None, :] <= (torch.arange(n)[:, None] + (m - n))
            scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return torch.einsum("hnm,mhd->nhd", probs, v)

    def _llm(
        self,
        ctx: BagelContext,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        gen: torch.Tensor | None,
        causal: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """One ``forward_inference`` of the MoT language model over a query block attending to ``ctx``.

        ``gen`` (bool per row, or None) marks rows that take the generation expert ("gen" mode: latent
        rows); the rest take the understanding expert. Returns the final-normed hidden states and the
        block's own keys/values per layer.
        """
        h = embeds
        n = h.shape[0]
        new_keys, new_values = [], []
        for layer in range(self.num_layers):
            p = f"language_model.model.layers.{layer}"
            residual = h
            x = self._routed(h, gen, self._norm, f"{p}.input_layernorm", f"{p}.input_layernorm_moe_gen")
            attn = f"{p}.self_attn"
            q = self._routed(x, gen, self._linear, f"{attn}.q_proj", f"{attn}.q_proj_moe_gen")
            k = self._routed(x, gen, self._linear, f"{attn}.k_proj", f"{attn}.k_proj_moe_gen")
            v = self._routed(x, gen, self._linear, f"{attn}.v_proj", f"{attn}.v_proj_moe_gen")
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
            v = v.view(n, self.num_kv_heads, self.head_dim)
            q = self._routed(q, gen, self._norm, f"{attn}.q_norm", f"{attn}.q_norm_moe_gen")
            k = self._routed(k, gen, self._norm, f"{attn}.k_norm", f"{attn}.k_norm_moe_gen")
            q, k = self._rope(q, positions), self._rope(k, positions)
            new_keys.append(k)
            new_values.append(v)
            merged_k = torch.cat([ctx.keys[layer], k])
            merged_v = torch.cat([ctx.values[layer], v])
            out = self._attention(q, merged_k, merged_v, causal).reshape(n, self.num_heads * self.head_dim)
            out = self._routed(out, gen, self._linear, f"{attn}.o_proj", f"{attn}.o_proj_moe_gen")
            h = residual + out
            residual = h
            x = self._routed(
                h, gen, self._norm, f"{p}.post_attention_layernorm", f"{p}.post_attention_layernorm_moe_gen"
            )
            h = residual + self._routed(x, gen, self._mlp, f"{p}.mlp", f"{p}.mlp_moe_gen")
        final = self._routed(
            h, gen, self._norm, "language_model.model.norm", "language_model.model.norm_moe_gen"
        )
        return final, new_keys, new_values

    def _embed(self, ids: Sequence[int]) -> torch.Tensor:
        table = self.w["language_model.model.embed_tokens.weight"]
        return table[torch.tensor(list(ids), dtype=torch.long, device=self.device)]

    def _timestep_embedding(self, t: torch.Tensor) -> torch.Tensor:
        """DiT's sinusoidal embedding of t in [0, 1] (not x1000), then Linear-SiLU-Linear."""
        half = 128
        freqs = torch.exp(-math.log(10000) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs.to(t.device)[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.dtype)
        hidden = F.silu(self._linear(embedding, "time_embedder.mlp.0"))
        return self._linear(hidden, "time_embedder.mlp.2")

    def _positions(self, rope: int, n: int, shared: bool) -> torch.Tensor:
        if shared:
            return torch.full((n,), rope, dtype=torch.long, device=self.device)
        return torch.arange(rope, rope + n, dtype=torch.long, device=self.device)

    def new_context(self) -> BagelContext:
        empty = torch.zeros((0, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
        return BagelContext((empty,) * self.num_layers, (empty,) * self.num_layers, 0)

    def context_from_kv(self, kv: torch.Tensor | None, rope: int) -> BagelContext:
        """A handoff context (``kv`` may be None when ``kv_len`` is 0), checked against this model and
        moved to its device and dtype."""
        if kv is None or kv.shape[2:3] == (0,):
            return BagelContext(self.new_context().keys, self.new_context().values, int(rope))
        expected = (self.num_layers, 2, self.num_kv_heads, self.head_dim)
        if kv.ndim != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != expected:
            raise ValueError(
                f"kv must be [{self.num_layers}, 2, kv_len, {self.num_kv_heads}, {self.head_dim}], "
                f"got {tuple(kv.shape)}"
            )
        return BagelContext.from_kv(kv.to(device=self.device, dtype=self.dtype), rope)

    # -- context building ------------------------------------------------------------------------------

    def text_ids(self, text: str) -> list[int]:
        """The token ids a text segment adds: ``[<|im_start|>] + encode(text) + [<|im_end|>]``."""
        return [self.bos_id, *self.tokenizer.encode(text), self.eos_id]

    @torch.no_grad()
    def add_text(self, ctx: BagelContext, text: str) -> BagelContext:
        """Append a text segment (und expert, causal, consecutive positions)."""
        ids = self.text_ids(text)
        positions = self._positions(ctx.rope, len(ids), shared=False)
        _, keys, values = self._llm(ctx, self._embed(ids), positions, None, causal=True)
        return ctx._extended(keys, values, "text", ctx.rope + len(ids))

    def _layer_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight, bias = self.w[f"{name}.weight"], self.w[f"{name}.bias"]
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.vit_eps)

    @torch.no_grad()
    def vit_encode(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NaViT SigLIP on one ``[3, H, W]`` image (H, W multiples of the patch): ``(post_layernorm
        hidden [N, vit_hidden], 2-D position ids)``; full attention over the image's own patches."""
        pixels = pixels.to(device=self.device, dtype=self.dtype)
        ids = flattened_position_ids(pixels.shape[1], pixels.shape[2], self.vit_patch, self.vit_max_per_side)
        ids = ids.to(self.device)
        e = "vit_model.vision_model"
        h = self._linear(patchify(pixels, self.vit_patch), f"{e}.embeddings.patch_embedding")
        h = h + self.w[f"{e}.embeddings.position_embedding.weight"][ids]
        n, dim = h.shape
        head_dim = dim // self.vit_heads
        for i in range(self.vit_layers):
            p = f"{e}.encoder.layers.{i}"
            x = self._layer_norm(h, f"{p}.layer_norm1")
            q, k, v = (
                self._linear(x, f"{p}.self_attn.{proj}").view(n, self.vit_heads, head_dim)
                for proj in ("q_proj", "k_proj", "v_proj")
            )
            scores = torch.einsum("nhd,mhd->hnm", q, k) * (1.0 / math.sqrt(head_dim))
            out = torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), v).reshape(n, dim)
            h = h + self._linear(out, f"{p}.self_attn.out_proj")
            x = F.gelu(
                self._linear(self._layer_norm(h, f"{p}.layer_norm2"), f"{p}.mlp.fc1"), approximate="tanh"
            )
            h = h + self._linear(x, f"{p}.mlp.fc2")
        return self._layer_norm(h, f"{e}.post_layernorm"), ids

    @torch.no_grad()
    def vit_tokens(self, image: Image.Image) -> torch.Tensor:
        """The ViT transform, NaViT SigLIP, connector and ``vit_pos_embed``: ``[N, hidden]``."""
        hidden, ids = self.vit_encode(self.vit_transform(image))
        hidden = self._linear(
            F.gelu(self._linear(hidden, "connector.fc1"), approximate="tanh"), "connector.fc2"
        )
        return hidden + self.w["vit_pos_embed.pos_embed"][ids]

    def latent_position_ids(self, height: int, width: int) -> torch.Tensor:
        return flattened_position_ids(height, width, self.latent_downsample, self.max_latent_size).to(
            self.device
        )

    @torch.no_grad()
    def vae_latent_tokens(
        self, image: Image.Image, sample_posterior: bool = False, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, int, int]:
        """The VAE transform, FLUX encoder (posterior mean unless ``sample_posterior``), scale/shift and
        2x2 patchify: ``(tokens [h*w, p*p*z], H, W)``."""
        pixels = self.vae_transform(image).to(device=self.device, dtype=self.dtype)
        height, width = pixels.shape[1:]
        z = self.vae_encode(pixels[None], sample_posterior=sample_posterior, generator=generator)[0]
        h, w, p = height // self.latent_downsample, width // self.latent_downsample, self.latent_patch
        z = z[:, : h * p, : w * p].reshape(self.latent_channels, h, p, w, p)
        tokens = torch.einsum("chpwq->hwpqc", z).reshape(-1, p * p * self.latent_channels)
        return tokens, height, width

    @torch.no_grad()
    def vae_block_embeddings(
        self, image: Image.Image, sample_posterior: bool = False, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A VAE block's input rows ``[<|vision_start|>] + latents + [<|vision_end|>]`` (latents:
        ``vae2llm(tokens) + time_embedder(0) + latent_pos_embed``) and its gen-row mask."""
        tokens, height, width = self.vae_latent_tokens(pil_to_rgb(image), sample_posterior, generator)
        t0 = torch.tensor([0], device=self.device)  # a clean image: timestep 0
        pos = self.w["latent_pos_embed.pos_embed"][self.latent_position_ids(height, width)]
        return self._image_block(self._linear(tokens, "vae2llm") + self._timestep_embedding(t0) + pos)

    @torch.no_grad()
    def vit_block_embeddings(self, image: Image.Image) -> torch.Tensor:
        """A ViT block's input rows ``[<|vision_start|>] + ViT tokens + [<|vision_end|>]`` (all und)."""
        return self._image_block(self.vit_tokens(pil_to_rgb(image)))[0]

    def _image_block(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        markers = self._embed([self.start_of_image_id, self.end_of_image_id])
        embeds = torch.cat([markers[:1], tokens.to(markers.dtype), markers[1:]])
        gen = torch.ones(embeds.shape[0], dtype=torch.bool, device=self.device)
        gen[0] = gen[-1] = False
        return embeds, gen

    @torch.no_grad()
    def add_image(
        self,
        ctx: BagelContext,
        image: Image.Image,
        vae: bool = True,
        vit: bool = True,
        sample_posterior: bool = False,
        generator: torch.Generator | None = None,
    ) -> BagelContext:
        """Append an image: a VAE block (gen expert on latents), then a ViT block (und expert), each
        ``[<|vision_start|>] + tokens + [<|vision_end|>]`` at one shared position, full attention; each
        block advances the rope by 1. The image is used as given (``interleave`` resizes it first)."""
        if not (vae or vit):
            raise ValueError("add_image needs vae=True or vit=True")
        if vae:
            embeds, gen = self.vae_block_embeddings(image, sample_posterior, generator)
            ctx = self._add_block(ctx, embeds, gen, "vae")
        if vit:
            ctx = self._add_block(ctx, self.vit_block_embeddings(image), None, "vit")
        return ctx

    def _add_block(
        self, ctx: BagelContext, embeds: torch.Tensor, gen: torch.Tensor | None, kind: str
    ) -> BagelContext:
        positions = self._positions(ctx.rope, embeds.shape[0], shared=True)
        _, keys, values = self._llm(ctx, embeds, positions, gen, causal=False)
        return ctx._extended(keys, values, kind, ctx.rope + 1)

    # -- text ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def next_token_logits(self, ctx: BagelContext, token_id: int) -> tuple[torch.Tensor, BagelContext]:
        """Feed one token at ``ctx.rope`` (und, causal); its logits and the extended context."""
        positions = self._positions(ctx.rope, 1, shared=False)
        hidden, keys, values = self._llm(ctx, self._embed([token_id]), positions, None, causal=True)
        logits = F.linear(hidden, self.w["language_model.lm_head.weight"])[0]
        return logits, ctx._extended(keys, values, "text", ctx.rope + 1)

    @torch.no_grad()
    def generate_text(
        self,
        ctx: BagelContext,
        max_new_tokens: int = 499,
        do_sample: bool = False,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> list[int]:
        """The original ``generate_text``: start with ``<|im_start|>`` at ``ctx.rope``, stop before
        ``<|im_end|>`` or after ``max_new_tokens`` tokens; returns the tokens after the start token."""
        out: list[int] = []
        token = self.bos_id
        for _ in range(max_new_tokens):
            logits, ctx = self.next_token_logits(ctx, token)
            if do_sample:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, num_samples=1, generator=generator)[0])
            else:
                token = int(torch.argmax(logits, dim=-1))
            if token == self.eos_id:
                break
            out.append(token)
        return out

    def decode_text(self, ids: Sequence[int]) -> str:
        """The original's decoding of generated ids (start token included, then split on the markers)."""
        text = self.tokenizer.decode([self.bos_id, *ids])
        return text.split("<|im_end|>")[0].split("<|im_start|>")[1]

    # -- image generation ------------------------------------------------------------------------------

    def check_image_size(self, height: int, width: int) -> None:
        limit = self.max_latent_size * self.latent_downsample
        for name, value in (("height", height), ("width", width)):
            if value <= 0 or value % self.latent_downsample or value > limit:
                raise ValueError(
                    f"{name} must be a positive multiple of {self.latent_downsample} "
                    f"up to {limit}, got {value}"
                )

    def initial_noise(self, height: int, width: int, seed: int) -> torch.Tensor:
        """The spec's per-request noise ``[h*w, p*p*z]``: ``torch.Generator("cpu").manual_seed(seed)``."""
        h, w = height // self.latent_downsample, width // self.latent_downsample
        generator = torch.Generator("cpu").manual_seed(seed)
        shape = (h * w, self.latent_patch**2 * self.latent_channels)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        return noise.to(device=self.device)  # the flow state stays fp32 whatever the model's dtype

    @staticmethod
    def timesteps(num_inference_steps: int, timestep_shift: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(t_i, dt_i)`` for the N-1 Euler steps: shifted ``linspace(1, 0, N)``, as the original."""
        t = torch.linspace(1, 0, num_inference_steps)
        t = timestep_shift * t / (1 + (timestep_shift - 1) * t)
        return t[:-1], t[:-1] - t[1:]

    def _velocity(
        self, ctx: BagelContext, x: torch.Tensor, t: torch.Tensor, pos_ids: torch.Tensor
    ) -> torch.Tensor:
        """One branch of ``_forward_flow``: the denoising block at ``ctx.rope`` attending to ``ctx``."""
        pos = self.w["latent_pos_embed.pos_embed"][pos_ids]
        embeds, gen = self._image_block(
            self._linear(x.to(self.dtype), "vae2llm") + self._timestep_embedding(t.expand(x.shape[0])) + pos
        )
        positions = self._positions(ctx.rope, embeds.shape[0], shared=True)
        hidden, _, _ = self._llm(ctx, embeds, positions, gen, causal=False)
        return self._linear(hidden, "llm2vae")[1:-1]

    @staticmethod
    def combine_cfg(
        v: torch.Tensor,
        v_text: torch.Tensor | None,
        v_img: torch.Tensor | None,
        cfg_text_scale: float,
        cfg_img_scale: float,
        cfg_renorm_type: str,
        cfg_renorm_min: float,
    ) -> torch.Tensor:
        """The original ``_forward_flow`` guidance: text CFG, then image CFG, then the renorm."""
        if not cfg_text_scale > 1.0:
            return v
        assert v_text is not None
        if cfg_renorm_type == "text_channel":
            v_text_ = v_text + cfg_text_scale * (v - v_text)
            scale = (v.norm(dim=-1, keepdim=True) / (v_text_.norm(dim=-1, keepdim=True) + 1e-8)).clamp(
                min=cfg_renorm_min, max=1.0
            )
            v_text_ = v_text_ * scale
            if cfg_img_scale > 1.0:
                assert v_img is not None
                return v_img + cfg_img_scale * (v_text_ - v_img)
            return v_text_
        v_ = v_text + cfg_text_scale * (v - v_text)
        if cfg_img_scale > 1.0:
            assert v_img is not None
            v_ = v_img + cfg_img_scale * (v_ - v_img)
        if cfg_renorm_type == "global":
            norm_v, norm_v_ = torch.norm(v), torch.norm(v_)
        elif cfg_renorm_type == "channel":
            norm_v, norm_v_ = v.norm(dim=-1, keepdim=True), v_.norm(dim=-1, keepdim=True)
        else:
            raise ValueError(
                f"cfg_renorm_type must be one of {', '.join(CFG_RENORM_TYPES)}, got {cfg_renorm_type!r}"
            )
        return v_ * (norm_v / (norm_v_ + 1e-8)).clamp(min=cfg_renorm_min, max=1.0)

    @torch.no_grad()
    def generate_latent(
        self,
        cond: BagelContext,
        cfg_text: BagelContext,
        cfg_img: BagelContext,
        *,
        height: int,
        width: int,
        num_inference_steps: int = 50,
        timestep_shift: float = 3.0,
        cfg_text_scale: float = 4.0,
        cfg_img_scale: float = 1.5,
        cfg_interval: Sequence[float] = (0.4, 1.0),
        cfg_renorm_type: str = "global",
        cfg_renorm_min: float = 0.0,
        seed: int = 0,
        noise: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The original ``generate_image`` loop; the final latent tokens ``[h*w, p*p*z]``."""
        self.check_image_size(height, width)
        if cfg_renorm_type not in CFG_RENORM_TYPES:
            raise ValueError(
                f"cfg_renorm_type must be one of {', '.join(CFG_RENORM_TYPES)}, got {cfg_renorm_type!r}"
            )
        if num_inference_steps < 2:
            raise ValueError(f"num_inference_steps must be at least 2, got {num_inference_steps}")
        x = self.initial_noise(height, width, seed) if noise is None else noise.to(self.device, torch.float32)
        pos_ids = self.latent_position_ids(height, width)
        timesteps, dts = self.timesteps(num_inference_steps, timestep_shift)
        lo, hi = cfg_interval
        for t, dt in zip(timesteps, dts, strict=True):
            # The original compares the float32 t with the Python bounds (so t == 0.4 is outside (0.4, 1]).
            inside = bool(t > lo) and bool(t <= hi)
            text_scale, img_scale = (cfg_text_scale, cfg_img_scale) if inside else (1.0, 1.0)
            t = t.to(self.device)
            v = self._velocity(cond, x, t, pos_ids)
            v_text = self._velocity(cfg_text, x, t, pos_ids) if text_scale > 1.0 else None
            v_img = self._velocity(cfg_img, x, t, pos_ids) if img_scale > 1.0 else None
            v = self.combine_cfg(v, v_text, v_img, text_scale, img_scale, cfg_renorm_type, cfg_renorm_min)
            x = x - v.to(x.device) * dt.to(x.device)
        return x

    @torch.no_grad()
    def decode_latent(self, latent: torch.Tensor, height: int, width: int) -> np.ndarray:
        """Unpatchify, FLUX decode, then the original's ``((x * 0.5 + 0.5).clamp(0, 1) * 255)`` truncated to
        uint8: an ``HxWx3`` array."""
        h, w, p, c = (
            height // self.latent_downsample,
            width // self.latent_downsample,
            self.latent_patch,
            self.latent_channels,
        )
        z = latent.reshape(1, h, w, p, p, c)
        z = torch.einsum("nhwpqc->nchpwq", z).reshape(1, c, h * p, w * p)
        image = self.vae_decode(z)
        image = (image * 0.5 + 0.5).clamp(0, 1)[0].permute(1, 2, 0) * 255
        return image.to(torch.uint8).cpu().numpy()

    def generate_image(
        self,
        cond: BagelContext,
        cfg_text: BagelContext,
        cfg_img: BagelContext,
        *,
        height: int,
        width: int,
        num_inference_steps: int = 50,
        timestep_shift: float = 3.0,
        cfg_text_scale: float = 4.0,
        cfg_img_scale: float = 1.5,
        cfg_interval: Sequence[float] = (0.4, 1.0),
        cfg_renorm_type: str = "global",
        cfg_renorm_min: float = 0.0,
        seed: int = 0,
        noise: torch.Tensor | None = None,
    ) -> np.ndarray:
        """:meth:`generate_latent` then :meth:`decode_latent`: a uint8 ``HxWx3`` array. The defaults are the
        original inferencer's ``gen_image`` defaults."""
        latent = self.generate_latent(
            cond,
            cfg_text,
            cfg_img,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            timestep_shift=timestep_shift,
            cfg_text_scale=cfg_text_scale,
            cfg_img_scale=cfg_img_scale,
            cfg_interval=cfg_interval,
            cfg_renorm_type=cfg_renorm_type,
            cfg_renorm_min=cfg_renorm_min,
            seed=seed,
            noise=noise,
        )
        return self.decode_latent(latent, height, width)

    # -- FLUX autoencoder (modeling/autoencoder.py) ----------------------------------------------------

    def _conv(self, x: torch.Tensor, name: str, stride: int = 1, padding: int = 1) -> torch.Tensor:
        return F.conv2d(x, self.ae[f"{name}.weight"], self.ae[f"{name}.bias"], stride=stride, padding=padding)

    def _group_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.group_norm(x, 32, self.ae[f"{name}.weight"], self.ae[f"{name}.bias"], eps=1e-6)

    def _resnet(self, x: torch.Tensor, name: str) -> torch.Tensor:
        h = self._conv(_swish(self._group_norm(x, f"{name}.norm1")), f"{name}.conv1")
        h = self._conv(_swish(self._group_norm(h, f"{name}.norm2")), f"{name}.conv2")
        if f"{name}.nin_shortcut.weight" in self.ae:
            x = self._conv(x, f"{name}.nin_shortcut", padding=0)
        return x + h

    def _ae_attention(self, x: torch.Tensor, name: str) -> torch.Tensor:
        h = self._group_norm(x, f"{name}.norm")
        b, c, height, width = h.shape
        q, k, v = (
            self._conv(h, f"{name}.{proj}", padding=0).reshape(b, 1, c, height * width).transpose(2, 3)
            for proj in ("q", "k", "v")
        )
        h = F.scaled_dot_product_attention(q, k, v)
        h = h.transpose(2, 3).reshape(b, c, height, width)
        return x + self._conv(h, f"{name}.proj_out", padding=0)

    def _mid(self, h: torch.Tensor, name: str) -> torch.Tensor:
        h = self._resnet(h, f"{name}.block_1")
        h = self._ae_attention(h, f"{name}.attn_1")
        return self._resnet(h, f"{name}.block_2")

    @torch.no_grad()
    def vae_encode(
        self, pixels: torch.Tensor, sample_posterior: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """``[B, 3, H, W]`` in [-1, 1] -> scaled latent ``scale * (z - shift)`` ``[B, z, H/8, W/8]``."""
        levels, blocks = len(self.vae_config["ch_mult"]), int(self.vae_config["num_res_blocks"])
        h = self._conv(pixels, "encoder.conv_in")
        for i in range(levels):
            for j in range(blocks):
                h = self._resnet(h, f"encoder.down.{i}.block.{j}")
            if i != levels - 1:
                h = self._conv(
                    F.pad(h, (0, 1, 0, 1)), f"encoder.down.{i}.downsample.conv", stride=2, padding=0
                )
        h = self._mid(h, "encoder.mid")
        h = self._conv(_swish(self._group_norm(h, "encoder.norm_out")), "encoder.conv_out")
        mean, logvar = torch.chunk(h, 2, dim=1)
        z = mean
        if sample_posterior:
            noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
            z = mean + torch.exp(0.5 * logvar) * noise
        return self.vae_config["scale_factor"] * (z - self.vae_config["shift_factor"])

    @torch.no_grad()
    def vae_decode(self, z: torch.Tensor) -> torch.Tensor:
        """Scaled latent ``[B, z, h, w]`` -> image ``[B, 3, 8h, 8w]`` (about [-1, 1])."""
        levels, blocks = len(self.vae_config["ch_mult"]), int(self.vae_config["num_res_blocks"])
        z = z / self.vae_config["scale_factor"] + self.vae_config["shift_factor"]  # in z's dtype (fp32)
        h = self._mid(self._conv(z.to(self.dtype), "decoder.conv_in"), "decoder.mid")
        for i in reversed(range(levels)):
            for j in range(blocks + 1):
                h = self._resnet(h, f"decoder.up.{i}.block.{j}")
            if i != 0:
                h = self._conv(
                    F.interpolate(h, scale_factor=2.0, mode="nearest"), f"decoder.up.{i}.upsample.conv"
                )
        return self._conv(_swish(self._group_norm(h, "decoder.norm_out")), "decoder.conv_out")

    # -- the original interleave_inference -------------------------------------------------------------

    def default_image_size(self) -> int:
        """The original's 1024, capped at the largest size the model's latent table covers."""
        return min(1024, self.max_latent_size * self.latent_downsample)

    @torch.no_grad()
    def interleave(
        self,
        inputs: Sequence[str | Image.Image],
        *,
        think: bool = False,
        understanding: bool = False,
        max_think_token_n: int = 1000,
        do_sample: bool = False,
        text_temperature: float = 0.3,
        text_generator: torch.Generator | None = None,
        cfg_text_scale: float = 3.0,
        cfg_img_scale: float = 1.5,
        cfg_interval: Sequence[float] = (0.4, 1.0),
        timestep_shift: float = 3.0,
        num_inference_steps: int = 50,
        cfg_renorm_min: float = 0.0,
        cfg_renorm_type: str = "global",
        height: int | None = None,
        width: int | None = None,
        seed: int = 0,
    ) -> InterleaveResult:
        """The original ``interleave_inference`` (same defaults) with its context bookkeeping.

        Text segments extend cond and cfg_img, and cfg_text becomes the context before the text; images
        (resized by the VAE transform first) extend cond only (VAE block then ViT block; ViT only for
        understanding), cfg_text becomes the context after the image, and the output size becomes the
        resized image's. Think mode puts the system prompt on cond and cfg_img, and the generated
        thinking text, decoded and re-encoded, on cond only. Without an input image the output size is
        ``height``/``width`` (default :meth:`default_image_size`).
        """
        cond = cfg_text = cfg_img = self.new_context()
        size = self.default_image_size()
        image_height, image_width = height or size, width or size
        outputs: list[Any] = []
        text: str | None = None
        text_ids: list[int] | None = None
        if think:
            system_prompt = VLM_THINK_SYSTEM_PROMPT if understanding else GEN_THINK_SYSTEM_PROMPT
            cond = self.add_text(cond, system_prompt)
            cfg_img = self.add_text(cfg_img, system_prompt)
        for item in inputs:
            if isinstance(item, str):
                cfg_text = cond
                cond = self.add_text(cond, item)
                cfg_img = self.add_text(cfg_img, item)
            elif isinstance(item, Image.Image):
                resized = self.vae_transform.resize(pil_to_rgb(item))
                cond = self.add_image(cond, resized, vae=not understanding, vit=True)
                image_width, image_height = resized.size
                cfg_text = cond
            else:
                raise ValueError(f"unsupported input type: {type(item).__name__}")

        if understanding or think:
            text_ids = self.generate_text(
                cond,
                max_new_tokens=max_think_token_n - 1,
                do_sample=do_sample,
                temperature=text_temperature,
                generator=text_generator,
            )
            text = self.decode_text(text_ids)
            outputs.append(text)
        image = None
        if not understanding:
            if think:
                cond = self.add_text(cond, text or "")
            image = self.generate_image(
                cond,
                cfg_text,
                cfg_img,
                height=image_height,
                width=image_width,
                num_inference_steps=num_inference_steps,
                timestep_shift=timestep_shift,
                cfg_text_scale=cfg_text_scale,
                cfg_img_scale=cfg_img_scale,
                cfg_interval=cfg_interval,
                cfg_renorm_type=cfg_renorm_type,
                cfg_renorm_min=cfg_renorm_min,
                seed=seed,
            )
            outputs.append(image)
        return InterleaveResult(
            outputs=outputs,
            text=text,
            text_ids=text_ids,
            image=image,
            height=None if understanding else image_height,
            width=None if understanding else image_width,
            cond=cond,
            cfg_text=cfg_text,
            cfg_img=cfg_img,
        )
