"""BAGEL's generation forward: the image block attending to cached contexts, batched over rows.

A *row* is one (request, context) pair. Every denoising step runs the block ``[latents..., start, end]``
(all at the row's RoPE position) through every layer: latent tokens with the generation expert
(``*_moe_gen``), the two marker tokens with the understanding expert, attention shared over the row's cached
context plus the block itself (non-causal). The order of tokens inside the block is ours (latents first, so
each expert reads one contiguous slice); attention is order-free, so it changes nothing.

Rows of a batch have contexts of different lengths. :class:`ContextBank` copies them (already post-RoPE, so
fixed across steps) once per batch into one padded buffer, per layer and row block first:
``[block (Q) | context (L_r) | padding]``; each step writes the block's fresh K/V into the first ``Q`` slots
and attends with a key mask. Rows are kept longest-context first, so
rows of similar length form contiguous groups that attend over their own (shorter) key range.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vllm_omni_plugin.diffusion.peer_group import PeerKept
from vllm_omni_plugin.models.bagel.config import BagelConfig, BagelConfigError
from vllm_omni_plugin.models.bagel.transforms import flattened_position_ids
from vllm_omni_plugin.models.bagel.weights import CheckpointReader

LAYER_PREFIX = "language_model.model.layers"
EMBED_TOKENS = "language_model.model.embed_tokens.weight"
NORM_GEN = "language_model.model.norm_moe_gen.weight"
TIME_FREQUENCIES = 256  # the DiT timestep embedder's sinusoid width
GROUP_SPLIT_RATIO = 0.5
"""A row starts a new attention group when its key range is under this share of the group's longest."""


@dataclass(slots=True)
class _Expert:
    """One expert of one layer, with projections fused for fewer matmuls."""

    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_weight: torch.Tensor
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor


@dataclass(slots=True)
class _Layer:
    und: _Expert
    gen: _Expert


def _expert_names(layer: int, suffix: str) -> dict[str, str]:
    base = f"{LAYER_PREFIX}.{layer}"
    attn = f"{base}.self_attn"
    names = {f"{p}_{kind}": f"{attn}.{p}_proj{suffix}.{kind}" for p in "qkv" for kind in ("weight", "bias")}
    names |= {
        "o_weight": f"{attn}.o_proj{suffix}.weight",
        "q_norm": f"{attn}.q_norm{suffix}.weight",
        "k_norm": f"{attn}.k_norm{suffix}.weight",
        "input_norm": f"{base}.input_layernorm{suffix}.weight",
        "post_norm": f"{base}.post_attention_layernorm{suffix}.weight",
        "gate": f"{base}.mlp{suffix}.gate_proj.weight",
        "up": f"{base}.mlp{suffix}.up_proj.weight",
        "down": f"{base}.mlp{suffix}.down_proj.weight",
    }
    return names


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2's RMSNorm: normalise in fp32, back to the input dtype, then scale."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GenerationTransformer:
    """The weights generation uses, and the batched velocity forward."""

    def __init__(self, cfg: BagelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        llm = cfg.llm
        self.num_layers = llm.num_layers
        self.num_heads = llm.num_heads
        self.num_kv_heads = llm.num_kv_heads
        self.head_dim = llm.head_dim
        self.eps = llm.rms_norm_eps
        self.layers: list[_Layer] = []
        self.markers: torch.Tensor | None = None  # [2, hidden]: <|vision_start|>, <|vision_end|>
        self.norm_gen: torch.Tensor | None = None
        self.time_mlp: tuple[torch.Tensor, ...] = ()
        self.vae2llm: tuple[torch.Tensor, torch.Tensor] | None = None
        self.llm2vae: tuple[torch.Tensor, torch.Tensor] | None = None
        self.latent_pos_embed: torch.Tensor | None = None

    # --- loading ------------------------------------------------------------------------------------

    @classmethod
    def load(
        cls, cfg: BagelConfig, reader: CheckpointReader, *, dtype: torch.dtype, device: torch.device
    ) -> GenerationTransformer:
        """Read only what generation needs from ``ema.safetensors``: both experts of every layer, two rows
        of the embedding table, ``norm_moe_gen`` and the generation heads. No ViT, connector, lm_head."""
        model = cls(cfg, dtype=dtype, device=device)
        llm = cfg.llm
        hidden, q_width = llm.hidden_size, llm.num_heads * llm.head_dim
        kv_width = llm.num_kv_heads * llm.head_dim

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            found = reader.shape(name)
            if found != shape:
                raise BagelConfigError(f"{reader.path}: {name} has shape {found}; the config needs {shape}")
            return reader.tensor(name, dtype=dtype, device=device)

        for layer in range(llm.num_layers):
            experts = []
            for suffix in ("", "_moe_gen"):
                n = _expert_names(layer, suffix)
                experts.append(
                    _Expert(
                        input_norm=get(n["input_norm"], (hidden,)),
                        qkv_weight=torch.cat(
                            [
                                get(n["q_weight"], (q_width, hidden)),
                                get(n["k_weight"], (kv_width, hidden)),
                                get(n["v_weight"], (kv_width, hidden)),
                            ]
                        ),
                        qkv_bias=torch.cat(
                            [
                                get(n["q_bias"], (q_width,)),
                                get(n["k_bias"], (kv_width,)),
                                get(n["v_bias"], (kv_width,)),
                            ]
                        ),
                        q_norm=get(n["q_norm"], (llm.head_dim,)),
                        k_norm=get(n["k_norm"], (llm.head_dim,)),
                        o_weight=get(n["o_weight"], (hidden, q_width)),
                        post_norm=get(n["post_norm"], (hidden,)),
                        gate_up_weight=torch.cat(
                            [
                                get(n["gate"], (llm.intermediate_size, hidden)),
                                get(n["up"], (llm.intermediate_size, hidden)),
                            ]
                        ),
                        down_weight=get(n["down"], (hidden, llm.intermediate_size)),
                    )
                )
            model.layers.append(_Layer(und=experts[0], gen=experts[1]))

        embed_shape = reader.shape(EMBED_TOKENS)
        if len(embed_shape) != 2 or embed_shape[1] != hidden:
            raise BagelConfigError(
                f"{reader.path}: {EMBED_TOKENS} has shape {embed_shape}; hidden size is {hidden}"
            )
        tokens = cfg.tokens
        model.markers = reader.rows(
            EMBED_TOKENS, [tokens.start_of_image, tokens.end_of_image], dtype=dtype, device=device
        )
        model.norm_gen = get(NORM_GEN, (hidden,))
        model.time_mlp = (
            get("time_embedder.mlp.0.weight", (hidden, TIME_FREQUENCIES)),
            get("time_embedder.mlp.0.bias", (hidden,)),
            get("time_embedder.mlp.2.weight", (hidden, hidden)),
            get("time_embedder.mlp.2.bias", (hidden,)),
        )
        token_dim = cfg.latent_token_dim
        model.vae2llm = (get("vae2llm.weight", (hidden, token_dim)), get("vae2llm.bias", (hidden,)))
        model.llm2vae = (get("llm2vae.weight", (token_dim, hidden)), get("llm2vae.bias", (token_dim,)))
        model.latent_pos_embed = get("latent_pos_embed.pos_embed", (cfg.max_latent_size**2, hidden))
        return model

    # --- per-batch constants ------------------------------------------------------------------------

    def time_embedding(self, timesteps: torch.Tensor) -> torch.Tensor:
        """DiT timestep embedding of ``t`` in [0, 1] (not scaled to 1000): ``[steps, hidden]``."""
        half = TIME_FREQUENCIES // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half).to(self.device)
        args = timesteps.to(self.device, torch.float32)[:, None] * freqs[None]
        sinusoid = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.dtype)
        w0, b0, w2, b2 = self.time_mlp
        return F.linear(F.silu(F.linear(sinusoid, w0, b0)), w2, b2)

    def latent_position_embedding(self, height: int, width: int) -> torch.Tensor:
        """``[h * w, hidden]`` for an image of ``height x width`` pixels."""
        ids = flattened_position_ids(
            height,
            width,
            self.cfg.latent_downsample,
            self.cfg.max_latent_size,
            interpolate=self.cfg.interpolate_pos,
        )
        return self.latent_pos_embed[ids.to(self.device)]

    def rope(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[rows, 1, 1, head_dim]`` of each row's single position (in the model dtype, as Qwen2's
        rotary embedding returns them)."""
        dim = self.head_dim
        inv_freq = 1.0 / (
            self.cfg.llm.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        freqs = torch.tensor(positions, dtype=torch.float32)[:, None] * inv_freq[None]
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        return cos[:, None, None].to(self.device), sin[:, None, None].to(self.device)

    # --- the step ----------------------------------------------------------------------------------

    def latent_input(self, x: torch.Tensor, time: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``vae2llm(x_t) + time embedding + position embedding``: ``[B, h*w, hidden]``."""
        weight, bias = self.vae2llm
        return F.linear(x.to(self.dtype), weight, bias) + time + positions

    def velocity(self, latents: torch.Tensor, rows: AttentionRows) -> torch.Tensor:
        """``[rows, h*w, hidden]`` latent-token inputs -> ``[rows, h*w, p*p*z]`` velocities."""
        count, n, _ = latents.shape
        markers = self.markers.unsqueeze(0).expand(count, -1, -1)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_width, kv_width = heads * dim, kv_heads * dim
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            gen, und = layer.gen, layer.und
            qkv_lat = F.linear(_rms_norm(latents, gen.input_norm, self.eps), gen.qkv_weight, gen.qkv_bias)
            qkv_mark = F.linear(_rms_norm(markers, und.input_norm, self.eps), und.qkv_weight, und.qkv_bias)
            q_lat, k_lat, v_lat = qkv_lat.split((q_width, kv_width, kv_width), dim=-1)
            q_mark, k_mark, v_mark = qkv_mark.split((q_width, kv_width, kv_width), dim=-1)
            q = torch.cat(
                [self._head_norm(q_lat, heads, gen.q_norm), self._head_norm(q_mark, heads, und.q_norm)], dim=1
            )
            k = torch.cat(
                [self._head_norm(k_lat, kv_heads, gen.k_norm), self._head_norm(k_mark, kv_heads, und.k_norm)],
                dim=1,
            )
            q = (q * rows.cos + _rotate_half(q) * rows.sin).to(self.dtype)
            k = (k * rows.cos + _rotate_half(k) * rows.sin).to(self.dtype)
            v = torch.cat([v_lat, v_mark], dim=1).view(count, n + 2, kv_heads, dim)
            attended = rows.attend(index, q, k, v)  # [rows, Q, heads * dim]
            latents = latents + F.linear(attended[:, :n], gen.o_weight)
            latents = latents + self._mlp(_rms_norm(latents, gen.post_norm, self.eps), gen)
            if index != last:  # the markers' last outputs feed nothing
                markers = markers + F.linear(attended[:, n:], und.o_weight)
                markers = markers + self._mlp(_rms_norm(markers, und.post_norm, self.eps), und)
        weight, bias = self.llm2vae
        return F.linear(_rms_norm(latents, self.norm_gen, self.eps), weight, bias)

    def _head_norm(self, x: torch.Tensor, heads: int, weight: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm in fp32 (BAGEL norms q and k in fp32 in generation mode)."""
        x32 = x.float().view(*x.shape[:-1], heads, self.head_dim)
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))

    @staticmethod
    def _mlp(x: torch.Tensor, expert: _Expert) -> torch.Tensor:
        gate, up = F.linear(x, expert.gate_up_weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, expert.down_weight)


@dataclass(slots=True)
class _Group:
    start: int
    end: int
    keys: int
    mask: torch.Tensor | None


_ROWS_IDS = itertools.count()


class AttentionRows(PeerKept):
    """The K/V buffers, masks and RoPE of one set of active rows (a view of the bank, or a copy).

    On a CFG-parallel replica a peer keeps the rows it computes (:class:`PeerKept`): their contexts go
    over the wire once per batch, not once per step."""

    def __init__(
        self,
        buffer: torch.Tensor,
        lengths: list[int],
        block: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_heads: int,
    ) -> None:
        self.buffer = buffer  # [layers, 2, rows, kv_heads, block + max_len, head_dim]
        self.lengths = lengths
        self.block = block
        self.cos, self.sin = cos, sin
        self.kv_heads = kv_heads
        self.wire_key = next(_ROWS_IDS)
        self._taken: dict[tuple[int, int], AttentionRows] = {}
        self.groups: list[_Group] = []
        start = 0
        while start < len(lengths):
            longest = block + lengths[start]
            end = start + 1
            # consecutive rows no longer than the first (the bank sorts them; rows joined from several
            # banks, step batching, are sorted within each)
            while end < len(lengths) and GROUP_SPLIT_RATIO * longest <= block + lengths[end] <= longest:
                end += 1
            mask = None
            if any(lengths[i] != lengths[start] for i in range(start, end)):
                limit = torch.tensor([block + lengths[i] for i in range(start, end)], device=buffer.device)
                mask = (torch.arange(longest, device=buffer.device)[None] < limit[:, None])[:, None, None]
            self.groups.append(_Group(start, end, longest, mask))
            start = end

    def take(self, start: int, end: int) -> AttentionRows:
        """The rows ``start:end`` (a view of this buffer: the same object for as long as this one lives,
        so a peer that holds it is sent no context again)."""
        if (start, end) == (0, len(self.lengths)):
            return self
        taken = self._taken.get((start, end))
        if taken is None:
            lengths = self.lengths[start:end]
            buffer = self.buffer[:, :, start:end, :, : self.block + max(lengths, default=0)]
            taken = AttentionRows(
                buffer, lengths, self.block, self.cos[start:end], self.sin[start:end], self.kv_heads
            )
            self._taken[(start, end)] = taken
        return taken

    def wire_state(self) -> dict[str, Any]:
        """The contexts (not the block's slots: :meth:`attend` writes them before it reads them)."""
        return {
            "contexts": self.buffer[:, :, :, :, self.block :],
            "lengths": self.lengths,
            "block": self.block,
            "cos": self.cos,
            "sin": self.sin,
            "kv_heads": self.kv_heads,
        }

    @classmethod
    def from_wire(cls, state: dict[str, Any], device: Any) -> AttentionRows:
        contexts, block = state["contexts"], state["block"]
        layers, two, rows, kv_heads, longest, dim = contexts.shape
        buffer = contexts.new_empty((layers, two, rows, kv_heads, block + longest, dim))
        buffer[:, :, :, :, block:] = contexts
        return cls(buffer, state["lengths"], block, state["cos"], state["sin"], state["kv_heads"])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Block ``q [rows, Q, heads, D]``, ``k, v [rows, Q, kv_heads, D]`` -> ``[rows, Q, heads * D]``."""
        rows, block, heads, dim = q.shape
        kv_heads = self.kv_heads
        share = heads // kv_heads
        keys, values = self.buffer[layer, 0], self.buffer[layer, 1]
        keys[:, :, :block] = k.transpose(1, 2)
        values[:, :, :block] = v.transpose(1, 2)
        # Grouped-query attention without repeating K/V: the queries of the heads that share a K/V head are
        # stacked along the sequence (attention is non-causal, so this is exact).
        grouped = (
            q.view(rows, block, kv_heads, share, dim).permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, -1, dim)
        )
        outputs = []
        for g in self.groups:
            outputs.append(
                F.scaled_dot_product_attention(
                    grouped[g.start : g.end],
                    keys[g.start : g.end, :, : g.keys],
                    values[g.start : g.end, :, : g.keys],
                    attn_mask=g.mask,
                )
            )
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return (
            out.view(rows, kv_heads, share, block, dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(rows, block, heads * dim)
        )


class ContextBank:
    """Every row's context K/V of a batch, copied once into a padded, block-first buffer.

    Slots are ordered longest context first. :meth:`rows` gives the attention inputs of a subset of slots:
    a view when the subset is all slots, else a copy (kept until the subset changes; a request's guidance
    rows switch on and off at most twice per batch).
    """

    def __init__(
        self,
        contexts: list[Any],
        block: int,
        model: GenerationTransformer,
    ) -> None:
        self.model = model
        self.block = block
        order = sorted(range(len(contexts)), key=lambda i: -int(contexts[i].kv_len))
        self.slot_of = [0] * len(contexts)
        for slot, row in enumerate(order):
            self.slot_of[row] = slot
        self.lengths = [int(contexts[row].kv_len) for row in order]
        self.ropes = [int(contexts[row].rope) for row in order]
        longest = self.lengths[0] if self.lengths else 0
        self.buffer = torch.zeros(
            (model.num_layers, 2, len(contexts), model.num_kv_heads, block + longest, model.head_dim),
            dtype=model.dtype,
            device=model.device,
        )
        for slot, row in enumerate(order):
            length = self.lengths[slot]
            if length:
                kv = contexts[row].kv.to(device=model.device, dtype=model.dtype)
                self.buffer[:, :, slot, :, block : block + length] = kv.permute(0, 1, 3, 2, 4)
        self._cached: tuple[tuple[int, ...], AttentionRows] | None = None

    def rows(self, slots: tuple[int, ...]) -> AttentionRows:
        """Attention inputs of ``slots`` (ascending)."""
        if self._cached is not None and self._cached[0] == slots:
            return self._cached[1]
        lengths = [self.lengths[s] for s in slots]
        if len(slots) == len(self.lengths):
            buffer = self.buffer
        else:
            index = torch.tensor(slots, device=self.buffer.device)
            buffer = self.buffer[:, :, :, :, : self.block + lengths[0]].index_select(2, index)
        cos, sin = self.model.rope([self.ropes[s] for s in slots])
        rows = AttentionRows(buffer, lengths, self.block, cos, sin, self.model.num_kv_heads)
        self._cached = (slots, rows)
        return rows
