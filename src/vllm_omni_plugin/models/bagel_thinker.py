"""BAGEL's thinker (stage 0) on stock vLLM's ``BagelForConditionalGeneration``.

Stock vLLM serves BAGEL for understanding only: Qwen2 with QK-norm, a fixed-size SigLIP, causal
attention, one position per token. Generation needs BAGEL's context as its authors build it, so this
subclass keeps what vLLM has (the Qwen2 stack, SigLIP, the connector, the weight loading) and adds:

* **VAE blocks.** An input image for editing enters the context twice: a block of VAE latent tokens
  (FLUX encoder, posterior mean, 2x2 patches, ``vae2llm`` + timestep-0 embedding + latent position table),
  then a block of ViT tokens. Understanding requests send the ViT block only
  (``mm_processor_kwargs={"bagel_vae": False}``).
* **Mixture of Transformers.** Every decoder layer carries BAGEL's generation expert (``*_moe_gen``
  weights); rows of VAE tokens (``<|vision_pad|>`` placeholders) run through it, all other rows through
  the understanding expert, and attention is shared. The model sees the token ids beside the embeddings
  (``requires_raw_input_tokens``) to route rows.
* **Positions.** A whole image block (markers and tokens) shares one RoPE position and the next block or
  text token advances by one. vLLM's M-RoPE path carries them: configuration resolution sets
  ``rope_parameters.mrope_section`` (three identical rows, so it is BAGEL's 1-D RoPE) and
  :meth:`get_mrope_input_positions` returns the positions.
* **Full attention inside image blocks.** vLLM's CPU attention backend has no bidirectional (prefix-LM)
  ranges, so after vLLM's causal attention the rows of each image block are attended again over the
  request's whole prefix plus their block (a block is a run of equal positions in a request's scheduled
  tokens; cached prefix keys are read back from the paged cache). ``disable_chunked_mm_input`` keeps a
  block inside one step.
* **NaViT ViT.** Images keep their aspect ratio (BAGEL's transforms); SigLIP runs on each image's own
  patch grid with BAGEL's extrapolated 2-D position ids.
* **CUDA graphs.** Routing rows and finding image blocks reads the step on the host, which a CUDA graph
  capture forbids. Image rows only come in steps that carry multimodal embeddings, which the runner hands
  to :meth:`~OmniBagelForConditionalGeneration.embed_input_ids` outside the graph; steps without them
  (every decode step) and captures take a forward without host reads, so vLLM's default
  FULL_AND_PIECEWISE mode captures decode batches whole. A generated ``<|vision_pad|>`` is text there, as
  in BAGEL.

Prompts are token ids with one ``<|image_pad|>`` per image and the images as ``multi_modal_data``; the
multimodal processor expands each placeholder into ``[<|vision_start|>] + VAE tokens +
[<|vision_end|>]`` (edits) and ``[<|vision_start|>] + ViT tokens + [<|vision_end|>]``. Text segments are
BAGEL's ``<|im_start|> text <|im_end|>``, built by the stage-input processor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import vllm.envs as vllm_envs
from torch import nn
from transformers import BatchFeature
from vllm.config import VllmConfig
from vllm.config.multimodal import MultiModalDummyOptions
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.bagel import (
    BagelDummyInputsBuilder,
    BagelForConditionalGeneration,
    BagelProcessingInfo,
    PositionEmbedding,
)
from vllm.model_executor.models.interfaces import MultiModalEmbeddings, SupportsMRoPE
from vllm.model_executor.models.qwen2 import Qwen2MLP
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import MultiModalDataItems
from vllm.multimodal.processing import (
    BaseMultiModalProcessor,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)
from vllm.sequence import IntermediateTensors

from vllm_omni_plugin.ar_worker.paged_kv import layer_cpu_isa, read_tokens
from vllm_omni_plugin.compat import resolve
from vllm_omni_plugin.models.bagel.autoencoder import VaeEncoder
from vllm_omni_plugin.models.bagel.config import BagelConfig, cached_bagel_config
from vllm_omni_plugin.models.bagel.transforms import (
    ImageTransform,
    flattened_position_ids,
    normalized_tensor,
    patchify,
)

VAE_KWARG = "bagel_vae"
"""``mm_processor_kwargs`` key: False sends an image as a ViT block only (understanding)."""


# --- positions ------------------------------------------------------------------------------------


def bagel_positions(
    token_ids: Sequence[int], blocks: Sequence[tuple[int, int]], end_of_image: int
) -> tuple[np.ndarray, int]:
    """1-D positions of a prompt and the next position.

    ``blocks`` are the ``(offset, length)`` ranges of the multimodal placeholders; each holds one or two
    image blocks (``<|vision_start|> ... <|vision_end|>``), and every token of a block takes the block's
    position, which then advances by one. Text tokens count one by one.
    """
    n = len(token_ids)
    positions = np.empty(n, dtype=np.int64)
    ids = np.asarray(token_ids, dtype=np.int64)
    rope = 0
    cursor = 0
    for offset, length in sorted(blocks):
        text = offset - cursor
        positions[cursor:offset] = np.arange(rope, rope + text)
        rope += text
        start = offset
        ends = np.flatnonzero(ids[offset : offset + length] == end_of_image) + offset
        for end in ends.tolist():
            positions[start : end + 1] = rope
            rope += 1
            start = end + 1
        if start < offset + length:  # a block without its closing marker (never produced by our processor)
            positions[start : offset + length] = rope
            rope += 1
        cursor = offset + length
    positions[cursor:] = np.arange(rope, rope + n - cursor)
    rope += n - cursor
    return positions, rope


def context_next_position(vllm_config: Any, request: Any) -> int:
    """The position after a request's prompt (the DiT's latents start there), for the context export
    connector's scheduler side, which has the request but not the model."""
    images = [f for f in request.mm_features or () if f.modality == "image"]
    blocks = [(f.mm_position.offset, f.mm_position.length) for f in images]
    end_of_image = cached_bagel_config(vllm_config.model_config.model).tokens.end_of_image
    return bagel_positions(request.prompt_token_ids, blocks, end_of_image)[1]


@dataclass(frozen=True)
class _Run:
    start: int
    end: int
    request: int
    query_start: int
    cached: int
    """Tokens of the request before this step's chunk (in the paged cache)."""


class ImageBlockAttention:
    """The rows of each image block in this step, and their attention over prefix plus block.

    vLLM's attention is causal: row ``i`` of a block saw the rows before it. BAGEL lets every row of a
    block see the whole block; this recomputes those rows' outputs with the request's keys up to the
    block's end (from this step's keys and, for tokens computed in earlier steps, the paged cache).
    """

    def __init__(self, runs: list[_Run], block_tables: torch.Tensor | None) -> None:
        self.runs = runs
        self.block_tables = block_tables

    @classmethod
    def of_step(cls, positions: torch.Tensor, layer_name: str) -> ImageBlockAttention | None:
        row = positions[0] if positions.dim() == 2 else positions
        if row.numel() < 2:
            return None
        pos = row.cpu().numpy()
        if not (pos[1:] == pos[:-1]).any():
            return None
        metadata = resolve("get_attention_context")(layer_name)[0]
        if metadata is None:  # profiling / warm-up runs
            return None
        starts = metadata.query_start_loc.cpu().tolist()
        seq_lens = metadata.seq_lens.cpu().tolist()
        runs: list[_Run] = []
        for r in range(len(starts) - 1):
            qs, qe = int(starts[r]), int(starts[r + 1])
            if qe - qs < 2:
                continue
            cached = int(seq_lens[r]) - (qe - qs)
            segment = pos[qs:qe]
            change = np.flatnonzero(segment[1:] != segment[:-1]) + 1
            bounds = [0, *change.tolist(), qe - qs]
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                if b - a >= 2:
                    runs.append(_Run(qs + a, qs + b, r, qs, cached))
        if not runs:
            return None
        return cls(runs, getattr(metadata, "block_table", None))

    def apply(
        self,
        layer_name: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
    ) -> torch.Tensor:
        kv_cache = backend = isa = None
        for run in self.runs:
            keys = k[run.query_start : run.end].view(-1, num_kv_heads, head_dim)
            values = v[run.query_start : run.end].view(-1, num_kv_heads, head_dim)
            if run.cached > 0:
                if kv_cache is None:
                    _, layer, kv_cache, _ = resolve("get_attention_context")(layer_name)
                    backend, isa = layer.attn_backend, layer_cpu_isa(layer, kv_cache)
                assert self.block_tables is not None and backend is not None
                # the attention metadata's block table holds kernel block ids: no manager block size
                cached_k, cached_v = read_tokens(
                    kv_cache, backend, head_dim, self.block_tables[run.request], run.cached, cpu_isa=isa
                )
                keys = torch.cat([cached_k.to(keys.dtype), keys])
                values = torch.cat([cached_v.to(values.dtype), values])
            query = q[run.start : run.end].view(-1, num_heads, head_dim).transpose(0, 1)[None]
            attended = F.scaled_dot_product_attention(
                query,
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                scale=scale,
                enable_gqa=num_heads != num_kv_heads,
            )
            out[run.start : run.end] = attended[0].transpose(0, 1).reshape(run.end - run.start, -1)
        return out


# --- generation expert and heads --------------------------------------------------------------------


class BagelGenerationExpert(nn.Module):
    """One layer's ``*_moe_gen`` weights: BAGEL's generation expert beside vLLM's Qwen2 layer."""

    def __init__(self, llm_config: Any, head_dim: int, quant_config: Any, prefix: str) -> None:
        super().__init__()
        hidden = llm_config.hidden_size
        eps = llm_config.rms_norm_eps
        self.qkv_proj = QKVParallelLinear(
            hidden,
            head_dim,
            llm_config.num_attention_heads,
            llm_config.num_key_value_heads,
            bias=True,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            llm_config.num_attention_heads * head_dim,
            hidden,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.q_norm = RMSNorm(head_dim, eps=eps)
        self.k_norm = RMSNorm(head_dim, eps=eps)
        self.mlp = Qwen2MLP(
            hidden_size=hidden,
            intermediate_size=llm_config.intermediate_size,
            hidden_act=llm_config.hidden_act,
            quant_config=quant_config,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)


class TimestepEmbedder(nn.Module):
    """DiT's timestep embedding (256 sinusoid features of t in [0, 1], then Linear-SiLU-Linear)."""

    frequency_size = 256

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(self.frequency_size, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_size // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


def _rows(und: Any, gen: Any, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``und`` on the understanding rows of ``x``, ``gen`` on the generation rows (``mask``)."""
    if mask is None:
        return und(x)
    if bool(mask.all()):
        return gen(x)
    keep = ~mask
    und_out = und(x[keep])
    out = und_out.new_empty((x.shape[0], *und_out.shape[1:]))
    out[keep] = und_out
    out[mask] = gen(x[mask])
    return out


def _capturing(x: torch.Tensor) -> bool:
    """Whether ``x``'s CUDA stream is being captured into a graph (where a host read would abort it)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def check_cudagraph_mode(compilation_config: Any) -> None:
    """Refuses CUDA graph modes that would replay a graph for a prefill step with images.

    Image rows need the eager forward (it reads the step on the host), while a captured graph replays what
    its dummy batch did: text rows only. FULL_AND_PIECEWISE (vLLM's default) and FULL_DECODE_ONLY capture
    uniform decode batches only; PIECEWISE graphs live inside torch.compile'd modules, and this forward
    calls none. FULL, and vLLM 0.33's breakable graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``, which capture
    the whole forward of mixed batches too), would silently drop the image rows' treatment.
    """
    mode = getattr(compilation_config.cudagraph_mode, "name", "NONE")
    breakable = mode != "NONE" and bool(getattr(vllm_envs, "VLLM_USE_BREAKABLE_CUDAGRAPH", False))
    if mode == "FULL" or breakable:
        setting = "VLLM_USE_BREAKABLE_CUDAGRAPH=1" if breakable else "cudagraph_mode FULL"
        raise ValueError(
            f"the BAGEL thinker cannot run with {setting}: its image steps must run eagerly; use "
            "cudagraph_mode FULL_AND_PIECEWISE (the default) or FULL_DECODE_ONLY"
        )


def _linear(layer: nn.Module) -> Any:
    return lambda x: layer(x)[0]


# --- multimodal processing ----------------------------------------------------------------------------


class BagelThinkerProcessingInfo(BagelProcessingInfo):
    def bagel(self) -> BagelConfig:
        return cached_bagel_config(self.ctx.model_config.model)

    def get_hf_processor(self, **kwargs: object) -> Any:
        raise RuntimeError("the BAGEL thinker processes images itself; there is no HF processor to load")

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        cfg = self.bagel()
        vae = cfg.max_latent_size**2 + 2
        vit = cfg.vit_max_num_patch_per_side**2 + 2
        return {"image": vae + vit}


class BagelThinkerDummyInputsBuilder(BagelDummyInputsBuilder):
    def get_dummy_mm_data(
        self, seq_len: int, mm_counts: Mapping[str, int], mm_options: MultiModalDummyOptions | None = None
    ) -> dict[str, Any]:
        side = self.info.bagel().vae_transform.max_image_size
        return {
            "image": self._get_dummy_images(
                width=side,
                height=side,
                num_images=mm_counts.get("image", 0),
                overrides=(mm_options or {}).get("image"),
            )
        }


class BagelThinkerMultiModalProcessor(BaseMultiModalProcessor[BagelThinkerProcessingInfo]):
    """Each image -> BAGEL's transforms; each ``<|image_pad|>`` -> its VAE block (edits) and ViT block."""

    def _call_hf_processor(
        self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        cfg = self.info.bagel()
        with_vae = bool(hf_kwargs.get(VAE_KWARG, True))
        vae_transform, vit_transform = ImageTransform(cfg.vae_transform), ImageTransform(cfg.vit_transform)
        data: dict[str, Any] = {"vit_pixel_values": [], "vit_grid": []}
        if with_vae:
            data.update(vae_pixel_values=[], vae_grid=[])
        images = hf_data.get("images") or []
        for image in images if isinstance(images, list | tuple) else [images]:
            resized = vae_transform.resize(image)  # BAGEL resizes every input image for the VAE first
            if with_vae:
                pixels = normalized_tensor(resized)
                data["vae_pixel_values"].append(pixels)
                data["vae_grid"].append(torch.tensor(pixels.shape[1:]) // cfg.latent_downsample)
            vit_pixels = vit_transform(resized)
            data["vit_pixel_values"].append(vit_pixels)
            data["vit_grid"].append(torch.tensor(vit_pixels.shape[1:]) // cfg.vit.patch_size)
        return BatchFeature({k: (torch.stack(v) if k.endswith("grid") else v) for k, v in data.items()})

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return {
            name: MultiModalFieldConfig.batched("image")
            for name in hf_inputs
            if name.startswith(("vit_", "vae_"))
        }

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        tokens = self.info.bagel().tokens

        def replacement(item_idx: int) -> PromptUpdateDetails:
            item = out_mm_kwargs["image"][item_idx]
            seq: list[int] = []
            if "vae_grid" in item:
                h, w = (int(x) for x in item["vae_grid"].data.tolist())
                seq += [tokens.start_of_image, *[tokens.vision_pad] * (h * w), tokens.end_of_image]
            h, w = (int(x) for x in item["vit_grid"].data.tolist())
            seq += [tokens.start_of_image, *[tokens.image_pad] * (h * w), tokens.end_of_image]
            return PromptUpdateDetails.select_token_ids(seq, [tokens.vision_pad, tokens.image_pad])

        return [PromptReplacement(modality="image", target=[tokens.image_pad], replacement=replacement)]


# --- the model -----------------------------------------------------------------------------------------


def _items(value: Any) -> list[torch.Tensor]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    return [torch.as_tensor(v) for v in value]


_GEN_NAMES = {
    "self_attn.o_proj_moe_gen.": "moe_gen.o_proj.",
    "self_attn.q_norm_moe_gen.": "moe_gen.q_norm.",
    "self_attn.k_norm_moe_gen.": "moe_gen.k_norm.",
    "mlp_moe_gen.down_proj.": "moe_gen.mlp.down_proj.",
    "input_layernorm_moe_gen.": "moe_gen.input_layernorm.",
    "post_attention_layernorm_moe_gen.": "moe_gen.post_attention_layernorm.",
}
_GEN_STACKED = {
    "self_attn.q_proj_moe_gen.": ("moe_gen.qkv_proj.", "q"),
    "self_attn.k_proj_moe_gen.": ("moe_gen.qkv_proj.", "k"),
    "self_attn.v_proj_moe_gen.": ("moe_gen.qkv_proj.", "v"),
    "mlp_moe_gen.gate_proj.": ("moe_gen.mlp.gate_up_proj.", 0),
    "mlp_moe_gen.up_proj.": ("moe_gen.mlp.gate_up_proj.", 1),
}
_STAGE1_ONLY = ("decoder.", "llm2vae.", "language_model.model.norm_moe_gen.")
"""Weights only the generation stage uses; the thinker does not load them."""


@MULTIMODAL_REGISTRY.register_processor(
    BagelThinkerMultiModalProcessor,
    info=BagelThinkerProcessingInfo,
    dummy_inputs=BagelThinkerDummyInputsBuilder,
)
class OmniBagelForConditionalGeneration(BagelForConditionalGeneration, SupportsMRoPE):
    requires_raw_input_tokens = True
    step_has_images = False
    """Set by :meth:`embed_input_ids` for each real step, read by :meth:`forward`: image rows (VAE rows
    through the generation expert, image blocks attended again) only come with multimodal embeddings.
    Without them the forward never reads the step on the host, so vLLM can capture it in a CUDA graph.
    The forward does not clear it: vLLM's dual-batch overlap runs one step's forward once per micro-batch
    (in threads). A dummy run after an image step therefore runs eagerly, which is harmless outside a
    capture; captures come before any real step and the forward checks for one anyway."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        hf_config = vllm_config.model_config.hf_config
        cfg = cached_bagel_config(vllm_config.model_config.model)
        if cfg.interpolate_pos:
            raise ValueError(
                "the BAGEL thinker supports extrapolated ViT positions only (interpolate_pos: false)"
            )
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("the BAGEL thinker runs without pipeline parallelism")
        check_cudagraph_mode(vllm_config.compilation_config)
        if not resolve("uses_mrope")(hf_config):
            raise ValueError(
                "the BAGEL thinker needs M-RoPE positions (hf_overrides rope_parameters.mrope_section); "
                "serve it through the bagel pipeline, which sets them"
            )
        # BAGEL's loader settings: QK-norm, untied head, and one ViT layer fewer than vit_config says.
        hf_config.llm_config.qk_norm = True
        hf_config.llm_config.tie_word_embeddings = False
        hf_config.vit_config.num_hidden_layers = cfg.vit.num_layers
        hf_config.vit_config.vision_use_head = False
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.bagel = cfg
        llm = hf_config.llm_config
        quant_config = vllm_config.quant_config
        self.head_dim = cfg.llm.head_dim
        base = f"{prefix}.language_model.model.layers" if prefix else "language_model.model.layers"
        for i, layer in enumerate(self.language_model.model.layers):
            layer.moe_gen = BagelGenerationExpert(llm, self.head_dim, quant_config, f"{base}.{i}.moe_gen")
        hidden = cfg.llm.hidden_size
        self.vae_encoder = VaeEncoder(cfg.vae)
        self.time_embedder = TimestepEmbedder(hidden)
        self.vae2llm = nn.Linear(cfg.latent_token_dim, hidden)
        self.latent_pos_embed = PositionEmbedding(cfg.max_latent_size, hidden)

    # --- multimodal embeddings ---------------------------------------------------------------------

    def _vit_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        vision = self.vit_model.vision_model
        dtype = vision.embeddings.patch_embedding.weight.dtype
        device = vision.embeddings.patch_embedding.weight.device
        height, width = pixels.shape[-2:]
        patch = self.bagel.vit.patch_size
        ids = flattened_position_ids(height, width, patch, self.bagel.vit_max_num_patch_per_side).to(device)
        x = vision.embeddings.patch_embedding(pixels[None].to(device=device, dtype=dtype))
        x = x.flatten(2).transpose(1, 2) + vision.embeddings.position_embedding(ids)[None]
        x = vision.encoder(inputs_embeds=x, return_all_hidden_states=False)
        if vision.post_layernorm is not None:
            x = vision.post_layernorm(x)
        return self.connector(x[0]) + self.vit_pos_embed(ids).to(x.dtype)

    def _vae_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.vae2llm.weight
        latent = self.vae_encoder.encode(pixels[None].to(device=weight.device, dtype=weight.dtype))[0]
        p = self.bagel.latent_patch_size
        tokens = patchify(latent, p)
        rows, cols = latent.shape[1] // p, latent.shape[2] // p
        ids = flattened_position_ids(rows * p, cols * p, p, self.bagel.max_latent_size).to(weight.device)
        timestep = torch.zeros(tokens.shape[0], device=weight.device)
        return (
            self.vae2llm(tokens) + self.time_embedder(timestep) + self.latent_pos_embed(ids).to(weight.dtype)
        )

    def embed_multimodal(self, **kwargs: object) -> MultiModalEmbeddings:
        vit = _items(kwargs.get("vit_pixel_values"))
        vae = _items(kwargs.get("vae_pixel_values"))
        out = []
        with torch.no_grad():
            for i, vit_pixels in enumerate(vit):
                parts = [self._vae_tokens(vae[i])] if vae else []
                parts.append(self._vit_tokens(vit_pixels))
                out.append(torch.cat(parts))
        return tuple(out)

    # --- positions -------------------------------------------------------------------------------

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
    ) -> tuple[torch.Tensor, int]:
        blocks = [(f.mm_position.offset, f.mm_position.length) for f in mm_features if f.modality == "image"]
        positions, rope = bagel_positions(input_tokens, blocks, self.bagel.tokens.end_of_image)
        rows = torch.from_numpy(np.ascontiguousarray(np.broadcast_to(positions, (3, len(positions)))))
        return rows, rope - len(input_tokens)

    # --- the decoder ----------------------------------------------------------------------------

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: MultiModalEmbeddings | None = None,
        *,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Notes, from the host-side list alone, whether this step carries image rows.

        vLLM's runners (V1 ``_preprocess``, V2 ``prepare_inputs_embeds``) call this outside any CUDA graph
        for every real step, with the step's multimodal embeddings: empty unless placeholder rows are
        scheduled, so always empty for decode steps. Dummy and capture runs never call it.
        """
        self.step_has_images = multimodal_embeddings is not None and len(multimodal_embeddings) > 0
        return super().embed_input_ids(input_ids, multimodal_embeddings, is_multimodal=is_multimodal)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        model = self.language_model.model
        hidden = inputs_embeds if inputs_embeds is not None else model.embed_input_ids(input_ids)
        gen = blocks = None
        if self.step_has_images and not _capturing(hidden):  # eager only: it reads the step on the host
            if input_ids is not None:
                mask = input_ids[: hidden.shape[0]] == self.bagel.tokens.vision_pad
                gen = mask if bool(mask.any()) else None
            blocks = ImageBlockAttention.of_step(positions, model.layers[0].self_attn.attn.layer_name)
        for layer in model.layers:
            hidden = self._layer(layer, positions, hidden, gen, blocks)
        return model.norm(hidden)

    def _layer(
        self,
        layer: nn.Module,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        gen: torch.Tensor | None,
        blocks: ImageBlockAttention | None,
    ) -> torch.Tensor:
        expert = layer.moe_gen
        attn = layer.self_attn
        n = hidden.shape[0]
        x = _rows(layer.input_layernorm, expert.input_layernorm, hidden, gen)
        qkv = _rows(_linear(attn.qkv_proj), _linear(expert.qkv_proj), x, gen)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = _rows(attn.q_norm, expert.q_norm, q.reshape(n, attn.num_heads, self.head_dim), gen).reshape(n, -1)
        k = _rows(attn.k_norm, expert.k_norm, k.reshape(n, attn.num_kv_heads, self.head_dim), gen).reshape(
            n, -1
        )
        q, k = attn.rotary_emb(positions, q, k)
        out = attn.attn(q, k, v)
        if blocks is not None:
            out = blocks.apply(
                attn.attn.layer_name,
                q,
                k,
                v,
                out,
                attn.num_heads,
                attn.num_kv_heads,
                self.head_dim,
                attn.scaling,
            )
        hidden = hidden + _rows(_linear(attn.o_proj), _linear(expert.o_proj), out, gen)
        x = _rows(layer.post_attention_layernorm, expert.post_attention_layernorm, hidden, gen)
        return hidden + _rows(layer.mlp, expert.mlp, x, gen)

    # --- weights --------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        rest: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if name.startswith(_STAGE1_ONLY):
                continue
            target = self._own_weight_name(name)
            if target is None:
                rest.append((name, tensor))
                continue
            param_name, shard = target
            param = params[param_name]
            if shard is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(param_name)
        loaded |= self._load_vae_encoder(params, loaded)
        return loaded | set(super().load_weights(rest))

    def _load_vae_encoder(self, params: dict[str, nn.Parameter], loaded: set[str]) -> set[str]:
        """The encoder half of ``ae.safetensors``, read from that file when vLLM's weight iterator did not
        bring it (the hub's ``model.safetensors.index.json`` names ``ema.safetensors`` only)."""
        from vllm_omni_plugin.models.bagel.weights import CheckpointReader

        names = [name for name in params if name.startswith("vae_encoder.") and name not in loaded]
        if not names:
            return set()
        with CheckpointReader(self.bagel.vae_weights) as reader:
            for name in names:
                param = params[name]
                key = name.removeprefix("vae_encoder.")
                tensor = reader.tensor(key, dtype=param.dtype, device=param.device)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        return set(names)

    @staticmethod
    def _own_weight_name(name: str) -> tuple[str, Any] | None:
        """Where a weight the stock loader skips goes: ``(parameter name, shard)``; None for the rest."""
        if name.startswith("encoder."):
            return f"vae_encoder.{name}", None
        if name.startswith(("time_embedder.", "vae2llm.")):
            return name, None
        if name.startswith("latent_pos_embed.") or name.startswith("vit_pos_embed."):
            return None  # deterministic tables, recomputed (the stock loader drops them)
        if "_moe_gen." not in name:
            return None
        prefix, _, tail = name.partition("layers.")
        index, _, rest = tail.partition(".")
        base = f"{prefix}layers.{index}."
        for old, new in _GEN_NAMES.items():
            if rest.startswith(old):
                return base + new + rest[len(old) :], None
        for old, (new, shard) in _GEN_STACKED.items():
            if rest.startswith(old):
                return base + new + rest[len(old) :], shard
        raise ValueError(f"unexpected BAGEL generation-expert weight {name!r}")
