"""The tiny GLM-Image: the diffusers ``GlmImagePipeline`` in the zai-org/GLM-Image repository layout at toy
size (AR model, processor, DiT, VAE, glyph T5, scheduler; 64x64 images in seconds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_omni_plugin.families.glm_image import processors as glm_image_processors
from vllm_omni_plugin.models.glm_image_config import CODEBOOK_SIZE
from vllm_omni_plugin.tiny_models.components import corpus, seeded_init

# --- GLM-Image ----------------------------------------------------------------------------------------
#
# The real zai-org/GLM-Image repository layout (diffusers pipeline) at toy size: an autoregressive
# GlmImageForConditionalGeneration ("vision_language_encoder", stored bf16 like upstream) that writes VQ
# prior tokens, and a GlmImageTransformer2DModel DiT + AutoencoderKL + glyph T5 that turn them into pixels.

GLM_IMAGE_FACTOR = glm_image_processors.FACTOR
GLM_IMAGE_PREVIEW_SIDE = glm_image_processors.PREVIEW_SIDE
GLM_IMAGE_CODEBOOK_SIZE = CODEBOOK_SIZE
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
    return corpus() + numbers * 4


def glm_image_config() -> dict[str, Any]:
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


def build_glm_image(outdir: Path, cfg: dict[str, Any]) -> None:
    """A tiny GLM-Image (diffusers ``GlmImagePipeline``) in the upstream repository layout."""
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
    seeded_init(ar, generator)
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
    seeded_init(transformer, generator)
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
    seeded_init(vae, generator)
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
    seeded_init(text_encoder, generator)
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
        "`python -m vllm_omni_plugin.tiny_models glm-image OUTDIR`. For tests only: its images "
        "are noise.\n"
    )
