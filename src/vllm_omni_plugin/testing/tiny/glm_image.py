"""Tiny random-weight models of real architectures, built offline.

``python -m vllm_omni_plugin.testing.tiny_models KIND OUTDIR`` writes a model directory that vLLM,
transformers and diffusers load like the real thing. Builds are seeded and deterministic (the same
kind and config give byte-identical files) and cached by config hash: OUTDIR keeps a stamp with the
hash, and a second build with the same hash returns at once.

Every attention layer vLLM runs has head_dim 32, the smallest head size vLLM's CPU attention supports
(vLLM's Qwen2 derives head_dim as hidden_size / num_attention_heads).

Kinds: ``text`` (Qwen2 with a ChatML tokenizer), ``glm-image`` (the diffusers GLM-Image pipeline in the
upstream repository layout: AR model, processor, DiT, VAE, glyph T5, scheduler; 64x64 images in seconds),
``bagel`` (BAGEL-7B-MoT's hub layout: both MoT experts, NaViT SigLIP, FLUX autoencoder; see ``tiny_bagel``)
and the single-stage diffusers pipelines ``sd3``, ``flux``, ``qwen-image`` and ``qwen-image-edit`` (the
real component classes of each family; see ``tiny_sd3``, ``tiny_flux``, ``tiny_qwen_image``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# One definition of GLM-Image's grid math (re-exported for tests and benchmarks).
from vllm_omni_plugin.stage.processors import glm_image as glm_image_processors
from vllm_omni_plugin.stage.processors.glm_image import glm_image_grid as glm_image_grid
from vllm_omni_plugin.stage.processors.glm_image import glm_image_max_new_tokens as glm_image_max_new_tokens

STAMP_FILE = "tiny_model.json"
BUILDER_VERSION = 1

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A small fixed corpus: the tokenizer's merges are learned from it, deterministically.
_CORPUS_WORDS = (
    "the quick brown fox jumps over the lazy dog a red fox in the snow a photo of a cat "
    "hello world what is the capital of france paris is the capital of france one two three "
    "four five six seven eight nine ten image picture painting drawing of a mountain lake at "
    "sunset with trees and a small house on the shore generate an image please describe the "
    "scene in detail the sky is blue and the grass is green numbers 0 1 2 3 4 5 6 7 8 9 10 16 "
    "32 64 128 256 512 1024 system user assistant you are a helpful assistant"
).split()


def _corpus() -> list[str]:
    lines = []
    n = len(_CORPUS_WORDS)
    for i in range(400):
        lines.append(" ".join(_CORPUS_WORDS[(i * 7 + j * 3) % n] for j in range(12)))
    return lines


CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_chat_tokenizer(
    outdir: Path,
    vocab_size: int = 1024,
    specials: Sequence[str] = CHATML_SPECIAL_TOKENS,
    model_max_length: int = 512,
) -> int:
    """A byte-level BPE tokenizer with ChatML specials (ids 0, 1, ... in ``specials`` order) and a chat
    template; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=model_max_length,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(outdir)
    return len(fast)


def _text_config() -> dict[str, Any]:
    return {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,  # head_dim 32
        "num_key_value_heads": 1,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "tokenizer_vocab_size": 1024,
        "init_std": 0.5,
        "seed": 0,
    }


def build_text(outdir: Path, cfg: dict[str, Any]) -> None:
    """A tiny Qwen2ForCausalLM with a ChatML tokenizer."""
    import torch
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    vocab = build_chat_tokenizer(outdir, cfg["tokenizer_vocab_size"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(outdir)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rope_theta=cfg["rope_theta"],
        rms_norm_eps=cfg["rms_norm_eps"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(cfg["seed"])
    model = Qwen2ForCausalLM(config)
    generator = torch.Generator().manual_seed(cfg["seed"])
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                std = cfg["init_std"] / (param.shape[-1] ** 0.5) * 4
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(outdir, safe_serialization=True)


# --- GLM-Image ----------------------------------------------------------------------------------------
#
# The real zai-org/GLM-Image repository layout (diffusers pipeline) at toy size: an autoregressive
# GlmImageForConditionalGeneration ("vision_language_encoder", stored bf16 like upstream) that writes VQ
# prior tokens, and a GlmImageTransformer2DModel DiT + AutoencoderKL + glyph T5 that turn them into pixels.

GLM_IMAGE_FACTOR = glm_image_processors.FACTOR
GLM_IMAGE_PREVIEW_SIDE = glm_image_processors.PREVIEW_SIDE
GLM_IMAGE_CODEBOOK_SIZE = glm_image_processors.CODEBOOK_SIZE
GLM_IMAGE_START_ID = 16384  # <|dit_token_16384|>: image start, the tokenizer's bos
GLM_IMAGE_END_ID = 16385  # <|dit_token_16385|>: image end, eos
GLM_IMAGE_VISION_VOCAB = 16512  # lm_head width (text_config.vision_vocab_size)
GLM_IMAGE_VOCAB = 168064  # input embedding rows (text_config.vocab_size)
GLM_IMAGE_SPECIAL_BASE = 167841  # <|endoftext|>; GLM-4-style specials follow
GLM_IMAGE_SPECIALS = (  # from GLM_IMAGE_SPECIAL_BASE on, in the GLM-4 order
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",  # 167845: grid_bos_token
    "<eop>",  # 167846: grid_eos_token
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",  # 167855: image_token
    "<|video|>",
)
GLM_IMAGE_IMAGE_TOKEN_ID = GLM_IMAGE_SPECIAL_BASE + GLM_IMAGE_SPECIALS.index("<|image|>")

# Content only, no role tags; an image becomes <image start><|image|><image end> (the processor expands
# <|image|> to one placeholder per source-grid cell), text is copied.
GLM_IMAGE_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or 'image' in item -%}"
    "<|dit_token_16384|><|image|><|dit_token_16385|>"
    "{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def _glm_image_corpus() -> list[str]:
    # Numbers appear alone (after <sop>, no leading space) and after a space, so "16" and " 16" both
    # become single tokens, as in the grid prompt "<sop>16 16<eop>".
    numbers = [f"{n} {n}" for n in range(129)] + [f"{n} {m}" for n in range(1, 65) for m in (1, 2, 16)]
    return _corpus() + numbers * 4


def _glm_image_config() -> dict[str, Any]:
    return {
        "seed": 0,
        "tokenizer": {"bpe_vocab_size": 1024},
        "text": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,  # head_dim 32
            "num_key_value_heads": 1,
            "max_position_embeddings": 8192,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 3, 3],  # rotary half-dim 8 (real: 128 -> [8, 12, 12])
            "attention_bias": True,
            "rms_norm_eps": 1e-5,
        },
        "vision": {
            "hidden_size": 32,
            "depth": 2,
            "num_heads": 1,  # head_dim 32
            "intermediate_size": 64,
            "patch_size": 16,
            "image_size": 128,
        },
        "vq": {"embed_dim": 32, "num_embeddings": GLM_IMAGE_CODEBOOK_SIZE},
        "dit": {
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 16,
            "num_layers": 2,
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "text_embed_dim": 32,
            "time_embed_dim": 32,
            "condition_dim": 16,
        },
        "vae": {"block_out_channels": [8, 8, 16, 16], "latent_channels": 16, "norm_num_groups": 4},
        "glyph": {"d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 1, "d_kv": 32},
        "scheduler": {"base_shift": 0.25, "max_shift": 0.75, "base_image_seq_len": 256},
        "processor": {"min_pixels": 64 * 64, "max_pixels": 256 * 256},
        "generation": {"temperature": 0.9, "top_p": 0.75},
        # Random weights, but a sane AR: lm_head rows >= 16384 stay zero and the codebook rows have
        # std 0.5, so sampling never leaves the codebook (no EOS, no id the DiT cannot embed).
        "lm_head_codebook_std": 0.5,
    }


def build_glm_image_tokenizer(cfg: dict[str, Any]) -> Any:
    """GLM-Image's tokenizer layout at toy size; returns a ``PreTrainedTokenizerFast``.

    Ids 0..16511 are the special ``<|dit_token_i|>``, then a small byte-level BPE learned from a fixed
    corpus, unreachable filler entries up to 167841, then the GLM-4 specials (``<|endoftext|>``,
    ``<sop>`` 167845, ``<eop>`` 167846, ``<|image|>`` 167855, ...).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=cfg["bpe_vocab_size"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_glm_image_corpus(), trainer=trainer)
    learned = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]

    dit_tokens = [f"<|dit_token_{i}|>" for i in range(GLM_IMAGE_VISION_VOCAB)]
    vocab = {token: i for i, token in enumerate(dit_tokens)}
    for token, idx in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab[token] = GLM_IMAGE_VISION_VOCAB + idx
    for idx in range(len(vocab), GLM_IMAGE_SPECIAL_BASE):  # never produced: no merge leads there
        vocab[f"<|filler_{idx}|>"] = idx
    for offset, token in enumerate(GLM_IMAGE_SPECIALS):
        vocab[token] = GLM_IMAGE_SPECIAL_BASE + offset

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (*dit_tokens, *GLM_IMAGE_SPECIALS)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=f"<|dit_token_{GLM_IMAGE_START_ID}|>",
        eos_token=f"<|dit_token_{GLM_IMAGE_END_ID}|>",
        pad_token=f"<|dit_token_{GLM_IMAGE_END_ID}|>",
        unk_token=None,
        image_token="<|image|>",
        grid_bos_token="<sop>",
        grid_eos_token="<eop>",
        model_max_length=8192,
        padding_side="left",
    )
    for n in range(129):  # grid sizes ("<sop>16 16<eop>") must stay single tokens
        for probe in (str(n), f" {n}"):
            if len(fast(probe, add_special_tokens=False).input_ids) != 1:
                raise AssertionError(f"GLM-Image tiny tokenizer splits {probe!r}")
    return fast


def _seeded_init(model: Any, generator: Any, gain: float = 1.0) -> None:
    """Overwrite every parameter from ``generator``, in sorted-name order.

    Matrices get N(0, gain^2 / fan_in); norm weights 1 + N(0, 0.1^2); biases (norms included)
    N(0, 0.1^2), so a dropped bias or norm weight shows up as a numeric mismatch.
    """
    import torch

    norm_params = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if "norm" in type(module).__name__.lower()
        for name, _ in module.named_parameters(recurse=False)
    }
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim >= 2:
                value = noise * (gain / param[0].numel() ** 0.5)
            elif name in norm_params and name.endswith("weight"):
                value = 1.0 + 0.1 * noise
            else:
                value = 0.1 * noise
            param.copy_(value.to(param.dtype))


def build_glm_image(outdir: Path, cfg: dict[str, Any]) -> None:
    """A tiny GLM-Image (diffusers ``GlmImagePipeline``) in the upstream repository layout."""
    import torch

    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
        _build_glm_image(outdir, cfg)


def _build_glm_image(outdir: Path, cfg: dict[str, Any]) -> None:
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        GlmImagePipeline,
        GlmImageTransformer2DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        GenerationConfig,
        GlmImageConfig,
        GlmImageForConditionalGeneration,
        GlmImageImageProcessorPil,  # saved as "GlmImageImageProcessor"; needs no torchvision
        GlmImageProcessor,
        T5Config,
        T5EncoderModel,
    )

    generator = torch.Generator().manual_seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])  # module constructors draw from the global RNG; all overwritten below

    # Processor: GLM tokenizer + image processor (patch 16, no temporal patch, no merge) + chat template.
    tokenizer = build_glm_image_tokenizer(cfg["tokenizer"])
    image_processor = GlmImageImageProcessorPil(
        patch_size=cfg["vision"]["patch_size"],
        temporal_patch_size=1,
        merge_size=1,
        min_pixels=cfg["processor"]["min_pixels"],
        max_pixels=cfg["processor"]["max_pixels"],
    )
    processor = GlmImageProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=GLM_IMAGE_CHAT_TEMPLATE
    )

    # AR model.
    t, v = cfg["text"], cfg["vision"]
    ar_config = GlmImageConfig(
        text_config={
            "vocab_size": GLM_IMAGE_VOCAB,
            "vision_vocab_size": GLM_IMAGE_VISION_VOCAB,
            "hidden_size": t["hidden_size"],
            "intermediate_size": t["intermediate_size"],
            "num_hidden_layers": t["num_hidden_layers"],
            "num_attention_heads": t["num_attention_heads"],
            "num_key_value_heads": t["num_key_value_heads"],
            "max_position_embeddings": t["max_position_embeddings"],
            "attention_bias": t["attention_bias"],
            "rms_norm_eps": t["rms_norm_eps"],
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": t["rope_theta"],
                "partial_rotary_factor": t["partial_rotary_factor"],
                "mrope_section": list(t["mrope_section"]),
            },
            "pad_token_id": GLM_IMAGE_SPECIAL_BASE,
            "eos_token_id": GLM_IMAGE_END_ID,
        },
        vision_config={
            "hidden_size": v["hidden_size"],
            "depth": v["depth"],
            "num_heads": v["num_heads"],
            "intermediate_size": v["intermediate_size"],
            "patch_size": v["patch_size"],
            "image_size": v["image_size"],
            "spatial_merge_size": 1,
        },
        vq_config={
            "embed_dim": cfg["vq"]["embed_dim"],
            "num_embeddings": cfg["vq"]["num_embeddings"],
            "latent_channels": v["hidden_size"],
        },
        image_token_id=GLM_IMAGE_IMAGE_TOKEN_ID,
        image_start_token_id=GLM_IMAGE_START_ID,
        image_end_token_id=GLM_IMAGE_END_ID,
    )
    ar = GlmImageForConditionalGeneration(ar_config)
    _seeded_init(ar, generator)
    with torch.no_grad():
        head = ar.lm_head.weight
        head.zero_()
        codebook = torch.randn((GLM_IMAGE_CODEBOOK_SIZE, head.shape[1]), generator=generator)
        head[:GLM_IMAGE_CODEBOOK_SIZE] = codebook * cfg["lm_head_codebook_std"]
    ar = ar.to(torch.bfloat16)
    ar.generation_config = GenerationConfig(
        do_sample=True,
        temperature=cfg["generation"]["temperature"],
        top_p=cfg["generation"]["top_p"],
        eos_token_id=GLM_IMAGE_END_ID,
        pad_token_id=GLM_IMAGE_IMAGE_TOKEN_ID,
    )

    # DiT, VAE, glyph encoder, scheduler.
    transformer = GlmImageTransformer2DModel(
        **cfg["dit"], prior_vq_quantizer_codebook_size=cfg["vq"]["num_embeddings"]
    )
    _seeded_init(transformer, generator)
    vae_cfg = cfg["vae"]
    latent_channels = vae_cfg["latent_channels"]
    stats = torch.randn((2, latent_channels), generator=generator)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(vae_cfg["block_out_channels"]),
        up_block_types=("UpDecoderBlock2D",) * len(vae_cfg["block_out_channels"]),
        block_out_channels=tuple(vae_cfg["block_out_channels"]),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=vae_cfg["norm_num_groups"],
        sample_size=64,
        scaling_factor=1.0,
        latents_mean=[round(float(x) * 0.5, 4) for x in stats[0]],
        latents_std=[round(1.0 + 0.5 * float(x.abs()), 4) for x in stats[1]],
    )
    _seeded_init(vae, generator)
    g = cfg["glyph"]
    glyph_tokenizer = ByT5Tokenizer()
    text_encoder = T5EncoderModel(
        T5Config(
            vocab_size=len(glyph_tokenizer),
            d_model=g["d_model"],
            d_ff=g["d_ff"],
            d_kv=g["d_kv"],
            num_layers=g["num_layers"],
            num_heads=g["num_heads"],
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            is_encoder_decoder=False,
        )
    )
    _seeded_init(text_encoder, generator)
    s = cfg["scheduler"]
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=s["base_shift"],
        max_shift=s["max_shift"],
        base_image_seq_len=s["base_image_seq_len"],
        max_image_seq_len=4096,
        time_shift_type="linear",
    )

    pipe = GlmImagePipeline(
        tokenizer=glyph_tokenizer,
        processor=processor,
        text_encoder=text_encoder,
        vision_language_encoder=ar,
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
    )
    pipe.save_pretrained(outdir, safe_serialization=True)
    # diffusers names the library of any class whose module sits in a ``glm_image`` package after its own
    # ``pipelines/glm_image``: the transformers components come out as ("glm_image", ...). Upstream says
    # "transformers", and that is what ``from_pretrained`` can import.
    index_file = outdir / "model_index.json"
    index = json.loads(index_file.read_text())
    for name in ("processor", "vision_language_encoder"):
        index[name] = ["transformers", index[name][1]]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (outdir / "README.md").write_text(
        "# tiny GLM-Image\n\nRandom weights, zai-org/GLM-Image layout, built offline by "
        "`python -m vllm_omni_plugin.testing.tiny_models glm-image OUTDIR`. For tests only: its images "
        "are noise.\n"
    )


# --- BAGEL -----------------------------------------------------------------------------------------------
# The builder lives in tiny_bagel.py (imported lazily: it uses this module's tokenizer builder).


def _bagel_config() -> dict[str, Any]:
    from vllm_omni_plugin.testing.tiny_bagel import bagel_config

    return bagel_config()


def build_bagel(outdir: Path, cfg: dict[str, Any]) -> None:
    """A tiny BAGEL (ByteDance-Seed/BAGEL-7B-MoT hub layout); see ``tiny_bagel``."""
    import torch

    from vllm_omni_plugin.testing.tiny_bagel import build_bagel as _build

    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
        _build(outdir, cfg)


# --- single-stage diffusers pipelines ---------------------------------------------------------------------
# Each family's builder lives in its own module (tiny_sd3, tiny_flux, tiny_qwen_image), imported lazily.


def _lazy(module: str, name: str) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        import importlib

        import torch

        function = getattr(importlib.import_module(f"vllm_omni_plugin.testing.{module}"), name)
        if args:  # a build: leave the caller's global RNG as it was
            with torch.random.fork_rng(devices=[]):
                return function(*args)
        return function()

    return call


BUILDERS: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[Path, dict[str, Any]], None]]] = {
    "text": (_text_config, build_text),
    "glm-image": (_glm_image_config, build_glm_image),
    "bagel": (_bagel_config, build_bagel),
    "sd3": (_lazy("tiny_sd3", "sd3_config"), _lazy("tiny_sd3", "build_sd3")),
    "flux": (_lazy("tiny_flux", "flux_config"), _lazy("tiny_flux", "build_flux")),
    "qwen-image": (
        _lazy("tiny_qwen_image", "qwen_image_config"),
        _lazy("tiny_qwen_image", "build_qwen_image"),
    ),
    "qwen-image-edit": (
        _lazy("tiny_qwen_image", "qwen_image_edit_config"),
        _lazy("tiny_qwen_image", "build_qwen_image"),
    ),
}


def config_hash(kind: str, cfg: dict[str, Any]) -> str:
    blob = json.dumps({"kind": kind, "builder": BUILDER_VERSION, "config": cfg}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def build(kind: str, outdir: str | Path) -> Path:
    """Build (or reuse) the tiny model ``kind`` in ``outdir``; returns the directory."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown tiny model kind {kind!r}; known: {', '.join(sorted(BUILDERS))}")
    make_config, builder = BUILDERS[kind]
    cfg = make_config()
    digest = config_hash(kind, cfg)
    out = Path(outdir)
    stamp = out / STAMP_FILE
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()).get("hash") == digest:
                return out
        except (OSError, ValueError):
            pass
    if out.exists() and any(out.iterdir()) and not stamp.is_file():
        raise FileExistsError(f"{out} exists and is not a tiny model directory; refusing to overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and swap in, so a crash never leaves a half-built cache hit.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        builder(tmp, cfg)
        (tmp / STAMP_FILE).write_text(
            json.dumps({"kind": kind, "hash": digest, "config": cfg}, indent=2, sort_keys=True)
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_omni_plugin.testing.tiny_models",
        description="Build a tiny random-weight model of a real architecture, offline.",
    )
    parser.add_argument("kind", choices=sorted(BUILDERS))
    parser.add_argument("outdir")
    args = parser.parse_args(argv)
    try:
        out = build(args.kind, args.outdir)
    except (FileExistsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
