"""A tiny Stable Diffusion 3 (``StableDiffusion3Pipeline``) in the hub layout, random weights.

The real component classes at toy size: ``SD3Transformer2DModel`` (MMDiT, 16 latent channels, patch 2),
``AutoencoderKL`` (scale factor 8), two ``CLIPTextModelWithProjection`` encoders with ``CLIPTokenizer``s,
a ``T5EncoderModel`` with a ``T5Tokenizer`` and the ``FlowMatchEulerDiscreteScheduler``. The shapes keep
SD3's contracts: the two CLIP hidden states side by side are zero-padded to the T5 width
(``joint_attention_dim``) and their pooled projections concatenate to ``pooled_projection_dim``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def sd3_config() -> dict[str, Any]:
    return {
        "seed": 0,
        "tokenizers": {"clip_vocab_size": 768, "t5_vocab_size": 400},
        "clip": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
        },
        "clip_2": {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 1,
        },
        "t5": {"d_model": 64, "d_ff": 128, "d_kv": 32, "num_layers": 2, "num_heads": 2},
        "transformer": {
            "sample_size": 32,  # default size 32 * 8 = 256 pixels
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 16,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "caption_projection_dim": 32,
            "pos_embed_max_size": 64,  # up to 512x512 pixels
        },
        "vae": {
            "block_out_channels": [8, 8, 16, 16],
            "latent_channels": 16,
            "norm_num_groups": 4,
            "scaling_factor": 1.5305,
            "shift_factor": 0.0609,
        },
        "scheduler": {"shift": 3.0},
    }


def sd3_medium_shape_config() -> dict[str, Any]:
    """Stable Diffusion 3 medium's transformer (24 blocks, 1536 wide, 24 heads of 64, 2.0B parameters) and
    VAE at their real shapes, random weights stored in bfloat16, with the tiny text encoders: what a GPU
    spends a 1024x1024 image on (the DiT's 4096 image tokens and the VAE), for measuring acceleration on
    a device (``benchmarks/dit_acceleration.py --models sd3-medium-shape``); its prompts are as short as
    the real model's (77 CLIP + 256 T5 tokens)."""
    cfg = sd3_config()
    cfg["transformer"] = {
        "sample_size": 128,
        "patch_size": 2,
        "in_channels": 16,
        "out_channels": 16,
        "num_layers": 24,
        "attention_head_dim": 64,
        "num_attention_heads": 24,
        "caption_projection_dim": 1536,
        "pos_embed_max_size": 192,
    }
    cfg["vae"] = {
        **cfg["vae"],
        "block_out_channels": [128, 256, 512, 512],
        "layers_per_block": 2,
        "norm_num_groups": 32,
    }
    cfg["dtype"] = "bfloat16"
    return cfg


def build_sd3(outdir: Path, cfg: dict[str, Any]) -> None:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    from vllm_omni_plugin.tiny_models.components import (
        autoencoder_kl,
        clip_text_encoder,
        clip_tokenizer,
        seeded_init,
        t5_encoder,
        t5_tokenizer,
    )

    generator = torch.Generator().manual_seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])  # constructors draw from the global RNG; every weight is overwritten
    sizes = cfg["tokenizers"]
    tokenizer, tokenizer_2 = (
        clip_tokenizer(sizes["clip_vocab_size"]),
        clip_tokenizer(sizes["clip_vocab_size"]),
    )
    tokenizer_3 = t5_tokenizer(sizes["t5_vocab_size"])
    text_encoder = clip_text_encoder(tokenizer, cfg["clip"], generator, with_projection=True)
    text_encoder_2 = clip_text_encoder(tokenizer_2, cfg["clip_2"], generator, with_projection=True)
    text_encoder_3 = t5_encoder(tokenizer_3, cfg["t5"], generator)
    pooled = cfg["clip"]["hidden_size"] + cfg["clip_2"]["hidden_size"]
    transformer = SD3Transformer2DModel(
        **cfg["transformer"], joint_attention_dim=cfg["t5"]["d_model"], pooled_projection_dim=pooled
    )
    seeded_init(transformer, generator)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg["scheduler"]["shift"]),
        vae=autoencoder_kl(cfg["vae"], generator),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    if "dtype" in cfg:  # the shape models: half the bytes to write and read
        pipe.transformer.to(getattr(torch, cfg["dtype"]))
        pipe.vae.to(getattr(torch, cfg["dtype"]))
    pipe.save_pretrained(outdir, safe_serialization=True)
    (outdir / "README.md").write_text(
        "# tiny Stable Diffusion 3\n\nRandom weights in the StableDiffusion3Pipeline layout, built offline "
        "by "
        "`python -m vllm_omni_plugin.tiny_models sd3 OUTDIR`. For tests only: its images are noise.\n"
    )
