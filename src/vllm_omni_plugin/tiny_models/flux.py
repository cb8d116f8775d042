"""A tiny FLUX.1 (``FluxPipeline``) in the hub layout, random weights; ``flux-fill`` is FLUX.1 Fill's layout
(``FluxFillPipeline``: the transformer reads the packed latents, the masked image's latents and the mask,
384 input channels, as FLUX.1-Fill-dev's).

The real component classes at toy size: ``FluxTransformer2DModel`` (double- and single-stream blocks,
guidance-distilled like FLUX.1-dev, RoPE axes summing to the head size), ``AutoencoderKL`` (16 latent
channels, scale factor 8; the pipeline packs 2x2 latent patches into 64 channels), ``CLIPTextModel`` (the
pooled text) with a ``CLIPTokenizer``, a ``T5EncoderModel`` (the token sequence) with a ``T5Tokenizer``
and the ``FlowMatchEulerDiscreteScheduler`` with FLUX's resolution-dependent shift.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def flux_config() -> dict[str, Any]:
    return {
        "seed": 0,
        "tokenizers": {"clip_vocab_size": 768, "t5_vocab_size": 400},
        "clip": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
        },
        "t5": {"d_model": 64, "d_ff": 128, "d_kv": 32, "num_layers": 2, "num_heads": 2},
        "transformer": {
            "patch_size": 1,
            "in_channels": 64,
            "num_layers": 1,
            "num_single_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "guidance_embeds": True,
            "axes_dims_rope": [4, 6, 6],
        },
        "vae": {
            "block_out_channels": [8, 8, 16, 16],
            "latent_channels": 16,
            "norm_num_groups": 4,
            "scaling_factor": 0.3611,
            "shift_factor": 0.1159,
        },
        "scheduler": {
            "base_shift": 0.5,
            "max_shift": 1.15,
            "base_image_seq_len": 256,
            "max_image_seq_len": 4096,
        },
    }


def flux_fill_config() -> dict[str, Any]:
    cfg = flux_config()
    cfg["fill"] = True
    cfg["transformer"] = {**cfg["transformer"], "in_channels": 384, "out_channels": 64}
    return cfg


def build_flux(outdir: Path, cfg: dict[str, Any]) -> None:
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxFillPipeline,
        FluxPipeline,
        FluxTransformer2DModel,
    )

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
    tokenizer, tokenizer_2 = clip_tokenizer(sizes["clip_vocab_size"]), t5_tokenizer(sizes["t5_vocab_size"])
    text_encoder = clip_text_encoder(tokenizer, cfg["clip"], generator, with_projection=False)
    text_encoder_2 = t5_encoder(tokenizer_2, cfg["t5"], generator)
    t = cfg["transformer"]
    transformer = FluxTransformer2DModel(
        **{**t, "axes_dims_rope": tuple(t["axes_dims_rope"])},
        joint_attention_dim=cfg["t5"]["d_model"],
        pooled_projection_dim=cfg["clip"]["hidden_size"],
    )
    seeded_init(transformer, generator)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, **cfg["scheduler"]
    )
    pipeline_cls = FluxFillPipeline if cfg.get("fill") else FluxPipeline
    pipe = pipeline_cls(
        transformer=transformer.eval(),
        scheduler=scheduler,
        vae=autoencoder_kl(cfg["vae"], generator),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )
    pipe.save_pretrained(outdir, safe_serialization=True)
    kind = "flux-fill" if cfg.get("fill") else "flux"
    (outdir / "README.md").write_text(
        f"# tiny FLUX.1\n\nRandom weights in the {pipeline_cls.__name__} layout, built offline by "
        f"`python -m vllm_omni_plugin.tiny_models {kind} OUTDIR`. For tests only: its images are "
        "noise.\n"
    )
