"""GLM-Image's autoregressive model (``GlmImageForConditionalGeneration``), native in vLLM.

The AR stage of GLM-Image (``zai-org/GLM-Image``, folder ``vision_language_encoder/``) is a GLM-4-style
decoder that writes VQ codebook ids of the image to generate: for text-to-image a ~16x16 preview grid,
then the large grid (one token per 32x32 pixels), then an end marker; for image-to-image the large grid
and the end marker, conditioned on the source image(s) turned into VQ ids by a small vision tower and a
vector quantizer. What differs from a plain decoder, and what this module does about it:

* **Vocabularies.** Input embeddings have the text vocabulary's rows, the LM head only
  ``text_config.vision_vocab_size`` (16512): ids 0..16383 are codebook ids, 16384/16385 image start/end.
  Configuration resolution narrows vLLM's ``vocab_size`` to the head's width (``hf_overrides``, see
  ``glm_image_config``) so the sampler works on 16512 ids; without it (a plain ``LLM(...)``)
  ``compute_logits`` pads the head's logits with ``-inf`` up to ``vocab_size`` so vLLM's sampler (which
  sizes its masks by the model config's vocab size, e.g. for ``allowed_token_ids``) sees a consistent width.
* **Positions (3-D M-RoPE, neox layout, partial rotary).** Text tokens get the same ramp on t/h/w, a
  source image gets (t=s, h=s+row, w=s+col) and advances the ramp by ``max(h, w)``. Generated tokens are
  positioned on the grid they belong to (t=base, h=base+row, w=base+col, base += max(h, w) per grid,
  preview first), which vLLM cannot derive from ``mrope_position_delta``. ``get_mrope_input_positions``
  therefore returns the prompt's positions followed by the whole precomputed decode plan; the plugin's
  V1 model runner (``vllm_omni_plugin.ar_worker``) takes completion positions from that plan, and on vLLM's
  V2 runner ``get_model_state_cls`` hands it ``ar_worker/planned_positions.py``'s model state, which does.
  The target grids are read from the prompt's scaffold ``<sop>H W<eop>`` (t2i: large then preview grid;
  i2i: the target grid), the source grids from the multimodal features.
* **Image-to-image.** The ``<|image|>`` placeholders of a source image are embedded as
  ``embed_tokens(vq_ids)``: vision tower (bilinear position-embedding interpolation, LayerNorm blocks,
  GELU MLP, no rotary, no merger) -> 1x1 conv -> nearest L2-normalised codebook entry.

Prompts are what ``GlmImageProcessor.apply_chat_template(..., target_h=H, target_w=W)`` produces, scaffold
and trailing image-start token included (pass the ids as ``prompt_token_ids``; text-to-image needs no
multimodal input). For image-to-image add the source image(s) as ``multi_modal_data``; the prompt may
hold one ``<|image|>`` per image or the processor's expanded run. Numerics follow transformers'
``GlmImageForConditionalGeneration`` (``models/glm_image``): greedy tokens are identical in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BatchFeature
from transformers.activations import ACT2FN
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.config.multimodal import MultiModalDummyOptions
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import MultiModalEmbeddings, SupportsMRoPE, SupportsMultiModal
from vllm.model_executor.models.llama import LlamaMLP
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import ImageSize, MultiModalDataItems
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
)
from vllm.sequence import IntermediateTensors

from vllm_omni_plugin.models.glm_image_config import SOURCE_GRIDS, SOURCE_TOKEN_IDS, embedding_rows

GRID_BOS_TOKEN = "<sop>"
GRID_EOS_TOKEN = "<eop>"


# --- M-RoPE position plan (pure functions: the tests compare them with transformers) ---------------------


def glm_image_prompt_length(
    token_ids: Sequence[int], grid_eos_token_id: int, image_start_token_id: int
) -> int:
    """Length of the prompt part of ``token_ids`` (prompt, or prompt + generated tokens).

    A GLM-Image prompt ends with its last grid scaffold ``<sop>H W<eop>`` and the image-start token. The
    AR can only emit ids below ``vision_vocab_size``, never ``<eop>``, so the last ``<eop>`` marks the
    prompt's end even when generated tokens follow (a request resumed after preemption). Without any
    scaffold the whole sequence counts as prompt.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    hits = np.flatnonzero(ids == grid_eos_token_id)
    if hits.size == 0:
        return len(ids)
    end = int(hits[-1]) + 1
    if end < len(ids) and ids[end] == image_start_token_id:
        end += 1
    return end


def parse_grid_scaffolds(
    token_ids: Sequence[int],
    grid_bos_token_id: int,
    grid_eos_token_id: int,
    decode: Callable[[list[int]], str],
) -> list[tuple[int, int]]:
    """The ``(H, W)`` of every ``<sop>H W<eop>`` scaffold in ``token_ids``, in prompt order."""
    ids = list(token_ids)
    grids: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] != grid_bos_token_id:
            i += 1
            continue
        try:
            j = ids.index(grid_eos_token_id, i + 1)
        except ValueError:
            break
        parts = decode(ids[i + 1 : j]).split()
        if len(parts) != 2 or not all(part.isdigit() for part in parts):
            raise ValueError(
                f"GLM-Image grid scaffold must read '<sop>H W<eop>', got {decode(ids[i : j + 1])!r}"
            )
        grids.append((int(parts[0]), int(parts[1])))
        i = j + 1
    return grids


def _grid_positions(base: int, h: int, w: int) -> np.ndarray:
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return np.stack([np.full(h * w, base), base + rows.reshape(-1), base + cols.reshape(-1)]).astype(np.int64)


def glm_image_rope_index(
    prompt_ids: Sequence[int],
    grids: Sequence[tuple[int, int]],
    image_start_token_id: int,
    image_end_token_id: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt positions ``[3, len(prompt_ids)]`` and decode positions ``[3, planned]`` of one prompt.

    ``grids`` is the sample's ``image_grid_thw`` as ``(h, w)`` pairs: source images first, then the
    target grid(s) in scaffold order. Same computation as transformers' ``GlmImageModel.get_rope_index``
    (one sample, no padding), including its decode plan (``_cached_decode_position_ids``).
    """
    ids = np.asarray(prompt_ids, dtype=np.int64)
    ends = np.flatnonzero(ids == image_end_token_id)
    starts = np.flatnonzero(ids == image_start_token_id) + 1
    chunks: list[np.ndarray] = []
    current = 0
    prev_end = 0
    for index, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=False)):
        if index >= len(grids):
            break
        n_text = start - prev_end
        chunks.append(np.broadcast_to(np.arange(current, current + n_text, dtype=np.int64), (3, n_text)))
        current += n_text
        h, w = grids[index]
        chunks.append(_grid_positions(current, h, w))
        current += max(h, w)
        prev_end = end
    n_text = len(ids) - prev_end
    chunks.append(np.broadcast_to(np.arange(current, current + n_text, dtype=np.int64), (3, n_text)))
    current += n_text
    prompt_positions = np.concatenate(chunks, axis=1)

    if not grids:
        return prompt_positions, np.zeros((3, 0), dtype=np.int64)
    decode_chunks: list[np.ndarray] = []
    base = current
    num_decode_grids = max(len(grids) - len(ends), 0)
    for i in range(1, num_decode_grids + 1):  # last grid first: t2i emits the preview before the large grid
        h, w = grids[-i]
        decode_chunks.append(_grid_positions(base, h, w))
        base += max(h, w)
    decode_chunks.append(np.full((3, 1), base, dtype=np.int64))  # end marker
    return prompt_positions, np.concatenate(decode_chunks, axis=1)


def glm_image_mrope_positions(
    token_ids: Sequence[int],
    source_grids: Sequence[tuple[int, int]],
    *,
    grid_bos_token_id: int,
    grid_eos_token_id: int,
    image_start_token_id: int,
    image_end_token_id: int,
    decode: Callable[[list[int]], str],
) -> np.ndarray:
    """Positions ``[3, prompt_len + planned decode tokens]`` for ``token_ids`` (prompt [+ generated]).

    Covers at least ``len(token_ids)``: a token past the plan gets what vLLM gives a generated token
    with ``mrope_position_delta`` 0 (its index), so a recomputed request agrees with a running one.
    """
    ids = list(token_ids)
    prompt_len = glm_image_prompt_length(ids, grid_eos_token_id, image_start_token_id)
    prompt = ids[:prompt_len]
    targets = parse_grid_scaffolds(prompt, grid_bos_token_id, grid_eos_token_id, decode)
    prompt_pos, decode_pos = glm_image_rope_index(
        prompt, [*source_grids, *targets], image_start_token_id, image_end_token_id
    )
    positions = np.concatenate([prompt_pos, decode_pos], axis=1)
    if len(ids) > positions.shape[1]:
        tail = np.arange(positions.shape[1], len(ids), dtype=np.int64)
        positions = np.concatenate([positions, np.broadcast_to(tail, (3, tail.size))], axis=1)
    return np.ascontiguousarray(positions)


# --- Vision tower and VQ quantizer (source images of image-to-image) ----------------------------------


class GlmImageVisionPatchEmbed(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.in_channels = config.in_channels
        self.embed_dim = config.hidden_size
        kernel = (self.patch_size, self.patch_size)
        self.proj = nn.Conv2d(self.in_channels, self.embed_dim, kernel_size=kernel, stride=kernel)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.view(-1, self.in_channels, self.patch_size, self.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, self.embed_dim)


class GlmImageVisionEmbeddings(nn.Module):
    """Learned square position table, bilinearly resampled to each image's patch grid."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        num_positions = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size)

    def forward(self, embeddings: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        weight = self.position_embedding.weight
        hidden = weight.shape[1]
        side = int(weight.shape[0] ** 0.5)
        table = weight.view(side, side, hidden).permute(2, 0, 1).unsqueeze(0).to(torch.float32)
        device = embeddings.device
        h_coords, w_coords, target_h, target_w = [], [], [], []
        for t, h, w in grid_thw:
            rows = torch.arange(h, device=device).repeat_interleave(w).repeat(t)
            cols = torch.arange(w, device=device).repeat(h * t)
            h_coords.append(rows)
            w_coords.append(cols)
            target_h.append(torch.full((t * h * w,), float(h), device=device))
            target_w.append(torch.full((t * h * w,), float(w), device=device))
        norm_w = ((torch.cat(w_coords) + 0.5) / torch.cat(target_w)) * 2 - 1
        norm_h = ((torch.cat(h_coords) + 0.5) / torch.cat(target_h)) * 2 - 1
        grid = torch.stack((norm_w, norm_h), dim=-1).unsqueeze(0).unsqueeze(2)
        sampled = F.grid_sample(table, grid, mode="bilinear", align_corners=False, padding_mode="border")
        pos = sampled.squeeze(0).squeeze(-1).permute(1, 0).to(weight.dtype)
        return embeddings + pos


class GlmImageVisionAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.scaling = self.head_dim**-0.5
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, head_dim]
        outputs = [
            F.scaled_dot_product_attention(qi, ki, vi, scale=self.scaling)
            for qi, ki, vi in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True)
        ]
        out = torch.cat(outputs, dim=2).squeeze(0).transpose(0, 1).reshape(n, -1)
        return self.proj(out)


class GlmImageVisionMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GlmImageVisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = GlmImageVisionAttention(config)
        self.mlp = GlmImageVisionMLP(config)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths)
        return x + self.mlp(self.norm2(x))


class GlmImageVisionModel(nn.Module):
    """GLM-Image's vision tower: patches -> hidden states, one per patch (no merger)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_embed = GlmImageVisionPatchEmbed(config)
        self.embeddings = GlmImageVisionEmbeddings(config)
        self.blocks = nn.ModuleList([GlmImageVisionBlock(config) for _ in range(config.depth)])

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        x = self.patch_embed(pixel_values)
        x = self.embeddings(x, grid_thw)
        lengths = [t * h * w for t, h, w in grid_thw]
        for block in self.blocks:
            x = block(x, lengths)
        return x


class GlmImageVectorQuantizer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embedding_dim = config.embed_dim
        self.embedding = nn.Embedding(config.num_embeddings, config.embed_dim)

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        """``[1, C, h, w]`` -> codebook ids ``[h * w]`` (row-major), nearest L2-normalised entry."""
        flat = hidden_state.permute(0, 2, 3, 1).contiguous().view(-1, self.embedding_dim)
        flat = F.normalize(flat, p=2, dim=-1)
        codebook = F.normalize(self.embedding.weight, p=2, dim=-1)
        distances = (
            torch.sum(flat**2, dim=1, keepdim=True)
            + torch.sum(codebook**2, dim=1)
            - 2 * torch.einsum("bd,dn->bn", flat, codebook.transpose(0, 1))
        )
        return torch.argmin(distances, dim=1)


class GlmImageVQVAE(nn.Module):
    """The encode half of GLM-Image's VQ model (the checkpoint's ``post_quant_conv`` is not needed)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.quant_conv = nn.Conv2d(config.latent_channels, config.embed_dim, 1)
        self.quantize = GlmImageVectorQuantizer(config)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """``[C, h, w]`` vision features of one image -> its codebook ids ``[h * w]``."""
        return self.quantize(self.quant_conv(features[None]))


# --- Text decoder ----------------------------------------------------------------------------------


class GlmImageTextAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        cache_config: CacheConfig | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = config.num_key_value_heads
        assert self.total_num_heads % tp_size == 0
        if self.total_num_kv_heads >= tp_size:
            assert self.total_num_kv_heads % tp_size == 0
        else:
            assert tp_size % self.total_num_kv_heads == 0
        self.num_heads = self.total_num_heads // tp_size
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=getattr(config, "attention_bias", True),
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        # GLM-Image rotates the two halves of the rotary slice (neox layout), unlike GLM-4.1V's
        # interleaved M-RoPE; only the first partial_rotary_factor of each head is rotated.
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            is_neox_style=True,
            rope_parameters=dict(config.rope_parameters),
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))
        return output


class GlmImageTextDecoderLayer(nn.Module):
    """GLM-4 block: pre-norm attention and MLP, each followed by its own RMSNorm before the residual."""

    def __init__(
        self,
        config: Any,
        cache_config: CacheConfig | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.self_attn = GlmImageTextAttention(
            config, cache_config, quant_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = LlamaMLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=quant_config,
            prefix=f"{prefix}.mlp",
        )
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps=eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states = self.post_self_attn_layernorm(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_mlp_layernorm(hidden_states)
        return hidden_states, residual


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class GlmImageTextModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config.text_config
        cache_config = vllm_config.cache_config
        quant_config = vllm_config.quant_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            embedding_rows(config),
            config.hidden_size,
            quant_config=quant_config,
            prefix=f"{prefix}.embed_tokens",
        )
        self.layers = nn.ModuleList(
            [
                GlmImageTextDecoderLayer(config, cache_config, quant_config, prefix=f"{prefix}.layers.{i}")
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stacked = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            for fused, part, shard in stacked:
                if f".{part}." not in name:
                    continue
                name = name.replace(f".{part}.", f".{fused}.")
                param = params[name]
                param.weight_loader(param, tensor, shard)
                break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


# --- Multimodal processing (image-to-image source images) ------------------------------------------


@functools.lru_cache(maxsize=4)
def _load_glm_image_processor(path: str) -> Any:
    from transformers import GlmImageProcessor

    return GlmImageProcessor.from_pretrained(path)


@functools.lru_cache(maxsize=4)
def _load_glm_image_image_processor(path: str) -> Any:
    """The image half of the processor alone: the engine core and every worker size the encoder budget
    with it at start-up, and loading the whole processor would parse the tokenizer (GLM's is 9 MB, about
    a second of CPU in each of those processes) for nothing."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path)


def glm_image_processor_dir(model: str, tokenizer: str | None) -> str | None:
    """Where the HF ``GlmImageProcessor`` lives: the tokenizer folder (upstream layout: ``processor/``
    next to ``vision_language_encoder/``), the model folder, or ``<model>/../processor``."""
    candidates = [tokenizer, model, str(Path(model) / ".." / "processor")] if model else [tokenizer]
    for candidate in candidates:
        if candidate and (Path(candidate) / "processor_config.json").is_file():
            return str(Path(candidate).resolve())
    return None


class GlmImageProcessingInfo(BaseProcessingInfo):
    @functools.cached_property
    def _processor_dir(self) -> str | None:
        """The local processor folder (``glm_image_processor_dir``), looked up once: the image processor is
        asked for at every size the encoder budget tries and at every request."""
        model_config = self.ctx.model_config
        return glm_image_processor_dir(model_config.model, model_config.tokenizer)

    def get_hf_processor(self, **kwargs: object) -> Any:
        if self._processor_dir is None:  # not a local upstream layout: let vLLM resolve it from the model
            return self.ctx.get_hf_processor(**kwargs)
        return _load_glm_image_processor(self._processor_dir)

    def get_image_processor(self, **kwargs: object) -> Any:
        if self._processor_dir is None:
            return self.get_hf_processor(**kwargs).image_processor
        return _load_glm_image_image_processor(self._processor_dir)

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {"image": self.get_max_image_tokens()}

    def get_num_image_tokens(self, *, image_width: int, image_height: int) -> int:
        return int(self.get_image_processor().get_number_of_image_patches(image_height, image_width, {}))

    @functools.cached_property
    def _image_size_with_most_features(self) -> ImageSize:
        image_processor = self.get_image_processor()
        step = image_processor.patch_size * image_processor.merge_size
        longest = int(round(float(image_processor.size["longest_edge"]) ** 0.5))
        best, best_tokens = step, -1
        for side in range(step, 4 * longest + 1, step):  # smart_resize halves first: scan up to 4x
            tokens = self.get_num_image_tokens(image_width=side, image_height=side)
            if tokens > best_tokens:
                best, best_tokens = side, tokens
        return ImageSize(width=best, height=best)

    def get_image_size_with_most_features(self) -> ImageSize:
        return self._image_size_with_most_features

    def get_max_image_tokens(self) -> int:
        size = self.get_image_size_with_most_features()
        return self.get_num_image_tokens(image_width=size.width, image_height=size.height)


class GlmImageDummyInputsBuilder(BaseDummyInputsBuilder[GlmImageProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        placeholder = GlmImageForConditionalGeneration.get_placeholder_str("image", 0)
        return placeholder * mm_counts.get("image", 0)

    def get_dummy_mm_data(
        self,
        seq_len: int,
        mm_counts: Mapping[str, int],
        mm_options: MultiModalDummyOptions | None = None,
    ) -> dict[str, Any]:
        size = self.info.get_image_size_with_most_features()
        return {
            "image": self._get_dummy_images(
                width=size.width,
                height=size.height,
                num_images=mm_counts.get("image", 0),
                overrides=(mm_options or {}).get("image"),
            )
        }


class GlmImageMultiModalProcessor(BaseMultiModalProcessor[GlmImageProcessingInfo]):
    """Source images -> ``pixel_values``/``image_grid_thw``; each ``<|image|>`` -> grid_h*grid_w placeholders.

    Prompts may carry one ``<|image|>`` per source image (vLLM expands it) or the already expanded run
    that ``GlmImageProcessor`` produces (collapsed here first, then expanded again).
    """

    def _call_hf_processor(
        self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        image_processor = self.info.get_image_processor()
        kwargs = {k: v for k, v in hf_kwargs.items() if k not in ("target_h", "target_w", "truncation")}
        return self.info.ctx.call_hf_processor(image_processor, {"images": hf_data["images"]}, kwargs)

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        grid_thw = hf_inputs.get("image_grid_thw", torch.empty((0, 3), dtype=torch.long))
        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", grid_thw.prod(-1)),
            "image_grid_thw": MultiModalFieldConfig.batched("image"),
        }

    def _image_token_id(self) -> int:
        return int(self.info.get_hf_config().image_token_id)

    def _postprocess_prompt(self, prompt: list[int]) -> list[int]:
        image_token_id = self._image_token_id()
        out: list[int] = []
        for token in prompt:
            if token == image_token_id and out and out[-1] == image_token_id:
                continue
            out.append(token)
        return out

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        image_token_id = self._image_token_id()

        def replacement(item_idx: int) -> list[int]:
            grid_thw = out_mm_kwargs["image"][item_idx]["image_grid_thw"].data
            return [image_token_id] * int(grid_thw.prod())

        return [PromptReplacement(modality="image", target=[image_token_id], replacement=replacement)]


# --- The model -------------------------------------------------------------------------------------


def _as_grid_list(image_grid_thw: Any) -> list[list[int]]:
    if isinstance(image_grid_thw, (list, tuple)):
        image_grid_thw = torch.stack([torch.as_tensor(g).reshape(3) for g in image_grid_thw])
    return [[int(v) for v in row] for row in torch.as_tensor(image_grid_thw).reshape(-1, 3).tolist()]


@MULTIMODAL_REGISTRY.register_processor(
    GlmImageMultiModalProcessor,
    info=GlmImageProcessingInfo,
    dummy_inputs=GlmImageDummyInputsBuilder,
)
class GlmImageForConditionalGeneration(nn.Module, SupportsMultiModal, SupportsMRoPE):
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={
            "model.language_model.": "language_model.",
            "model.visual.": "visual.",
            "model.vqmodel.post_quant_conv.": None,
            "model.vqmodel.": "vqmodel.",
        }
    )

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return "<|dit_token_16384|><|image|><|dit_token_16385|>"
        raise ValueError("GLM-Image accepts only image inputs")

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        text_config = config.text_config
        quant_config = vllm_config.quant_config
        self.config = config
        self.model_config = vllm_config.model_config
        self.vocab_size = text_config.vocab_size
        self.vision_vocab_size = text_config.vision_vocab_size

        with self._mark_tower_model(vllm_config, "image"):
            self.visual = GlmImageVisionModel(config.vision_config)
            self.vqmodel = GlmImageVQVAE(config.vq_config)
        with self._mark_language_model(vllm_config):
            self.language_model = GlmImageTextModel(
                vllm_config=vllm_config, prefix=maybe_prefix(prefix, "language_model")
            )
        self.lm_head = ParallelLMHead(
            self.vision_vocab_size,
            text_config.hidden_size,
            quant_config=quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        self.logits_processor = LogitsProcessor(self.vision_vocab_size)
        self._grid_tokens: tuple[int, int, Callable[[list[int]], str]] | None = None

    # Text generation ------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states)
        if logits is None or logits.shape[-1] >= self.vocab_size:
            return logits
        # The head only scores image ids; every other id of the (text) vocabulary is impossible.
        pad = logits.new_full((*logits.shape[:-1], self.vocab_size - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    # Image-to-image sources --------------------------------------------------------------------------

    def image_token_ids(self, pixel_values: torch.Tensor, image_grid_thw: Any) -> list[torch.Tensor]:
        """The VQ codebook ids of each source image (d32 grid, row-major), as the AR consumes them."""
        grids = _as_grid_list(image_grid_thw)
        if isinstance(pixel_values, (list, tuple)):
            pixel_values = torch.cat(list(pixel_values))
        features = self.visual(pixel_values.to(self.visual.dtype), grids)
        ids: list[torch.Tensor] = []
        for item, (t, h, w) in zip(features.split([t * h * w for t, h, w in grids]), grids, strict=True):
            maps = item.view(t, h, w, -1).permute(0, 3, 1, 2).reshape(-1, h, w)
            ids.append(self.vqmodel.encode(maps))
        return ids

    def omni_stage_outputs(self, mm_features: list[MultiModalFeatureSpec]) -> dict[str, Any] | None:
        """Per-request outputs of the AR stage for the next stage (the Omni runner asks once per new
        request): for image-to-image, the source images' VQ ids and their d32 grids (the family's
        processor brings them to the DiT's grid)."""
        images = [
            f
            for f in sorted(mm_features, key=lambda f: f.mm_position.offset)
            if f.modality == "image" and f.data
        ]
        if not images:
            return None
        ids: list[list[int]] = []
        grids: list[list[int]] = []
        with torch.no_grad():
            for feature in images:
                pixel_values = feature.data["pixel_values"].data
                grid = feature.data["image_grid_thw"].data.reshape(1, 3)
                (source,) = self.image_token_ids(pixel_values.to(next(self.visual.parameters()).device), grid)
                ids.append(source.view(-1).tolist())
                grids.append([int(x) for x in grid[0].tolist()])
        return {SOURCE_TOKEN_IDS: ids, SOURCE_GRIDS: grids}

    def embed_multimodal(self, **kwargs: object) -> MultiModalEmbeddings:
        pixel_values = kwargs.get("pixel_values")
        image_grid_thw = kwargs.get("image_grid_thw")
        if pixel_values is None or image_grid_thw is None:
            return []
        return tuple(
            self.language_model.embed_input_ids(ids)
            for ids in self.image_token_ids(pixel_values, image_grid_thw)
        )

    # M-RoPE ------------------------------------------------------------------------------------------

    def _grid_token_info(self) -> tuple[int, int, Callable[[list[int]], str]]:
        if self._grid_tokens is None:
            from vllm.tokenizers import cached_tokenizer_from_config

            tokenizer = cached_tokenizer_from_config(self.model_config)
            bos = getattr(tokenizer, "grid_bos_token", None) or GRID_BOS_TOKEN
            eos = getattr(tokenizer, "grid_eos_token", None) or GRID_EOS_TOKEN
            self._grid_tokens = (
                int(tokenizer.convert_tokens_to_ids(bos)),
                int(tokenizer.convert_tokens_to_ids(eos)),
                functools.lru_cache(maxsize=256)(lambda ids: tokenizer.decode(list(ids))),
            )
        bos_id, eos_id, cached_decode = self._grid_tokens
        return bos_id, eos_id, lambda ids: cached_decode(tuple(ids))

    @staticmethod
    def _source_grids(mm_features: list[MultiModalFeatureSpec]) -> list[tuple[int, int]]:
        grids = []
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            if feature.modality != "image":
                continue
            if feature.data is None:
                raise ValueError("GLM-Image M-RoPE needs the source image's image_grid_thw")
            t, h, w = (int(v) for v in feature.data["image_grid_thw"].data.reshape(-1).tolist())
            if t != 1:
                raise ValueError(f"GLM-Image source images have one frame, got grid {(t, h, w)}")
            grids.append((h, w))
        return grids

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
    ) -> tuple[torch.Tensor, int]:
        """Prompt positions followed by the precomputed decode positions, and a delta of 0.

        ``input_tokens`` is the prompt, or the prompt plus the tokens generated so far (a resumed
        request): those get their positions from the same decode plan.
        """
        bos_id, eos_id, decode = self._grid_token_info()
        positions = glm_image_mrope_positions(
            input_tokens,
            self._source_grids(mm_features),
            grid_bos_token_id=bos_id,
            grid_eos_token_id=eos_id,
            image_start_token_id=self.config.image_start_token_id,
            image_end_token_id=self.config.image_end_token_id,
            decode=decode,
        )
        return torch.from_numpy(positions), 0

    @staticmethod
    def get_model_state_cls() -> type:
        """vLLM's V2 model runner asks the model for its state class: ours takes the decode positions
        from the plan above (V2 would give them ``num_computed + delta``). Imported here, when V2 asks,
        so that the V1 runner and the CPU platform never load V2's modules."""
        from vllm_omni_plugin.ar_worker.planned_positions import PlannedMRopeModelState

        return PlannedMRopeModelState

    # Weights -----------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
