"""Tiny Wan video pipelines, random weights: ``wan`` is ``WanPipeline`` in the layout of
Wan-AI/Wan2.1-T2V-1.3B-Diffusers, ``wan-i2v`` is ``WanImageToVideoPipeline`` in that of
Wan-AI/Wan2.1-I2V-14B-480P-Diffusers, and ``wan2.2`` is ``WanPipeline`` in that of
Wan-AI/Wan2.2-T2V-A14B-Diffusers: two experts, ``transformer`` for the high-noise steps (timesteps at or
above ``boundary_ratio`` x 1000) and ``transformer_2`` (the same architecture, its own weights) for the rest,
``boundary_ratio`` 0.875 as the real pipeline config has it (its other components are ``wan``'s, at the same
config: the A14B experts have Wan 2.1 14B's architecture and the Wan 2.1 VAE).

The real component classes at toy size: ``WanTransformer3DModel`` (patch 1x2x2, 3-D RoPE split over frames,
rows and columns), ``AutoencoderKLWan`` (the causal 3-D VAE at its real compression: 8x spatial, 4x
temporal, 16 latent channels with per-channel mean and std), ``UMT5EncoderModel`` with a T5-style tokenizer
(the pipelines pad every prompt to 512 tokens), and the ``UniPCMultistepScheduler`` as Wan 2.1 480P ships it
(flow prediction, flow sigmas, shift 3). The image-to-video transformer reads 36 channels (16 noise, 4 mask,
16 latents of the conditioning video) and cross-attends to the penultimate hidden states of a
``CLIPVisionModel`` (ViT-H/14's 257 tokens at 224 pixels, here 32 wide) before the text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def wan_config() -> dict[str, Any]:
    return {
        "seed": 0,
        "i2v": False,
        "tokenizer": {"vocab_size": 400, "model_max_length": 512},
        "umt5": {
            "d_model": 32,
            "d_ff": 64,
            "d_kv": 16,
            "num_layers": 2,
            "num_heads": 2,
            "relative_attention_num_buckets": 32,  # umt5-xxl's
            "relative_attention_max_distance": 128,
        },
        "transformer": {
            "patch_size": [1, 2, 2],
            "num_attention_heads": 2,
            "attention_head_dim": 16,  # RoPE: 8 dims for frames, 4 each for rows and columns
            "in_channels": 16,
            "out_channels": 16,
            "freq_dim": 256,
            "ffn_dim": 64,
            "num_layers": 2,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "eps": 1e-6,
            "rope_max_seq_len": 1024,
        },
        "vae": {
            "base_dim": 8,
            "z_dim": 16,
            "dim_mult": [1, 2, 4, 4],  # three downsamples: 8x spatial
            "num_res_blocks": 1,
            "temperal_downsample": [False, True, True],  # two of them in time too: 4x temporal
        },
        "scheduler": {"flow_shift": 3.0},
    }


def wan22_config() -> dict[str, Any]:
    cfg = wan_config()
    cfg["boundary_ratio"] = 0.875  # Wan2.2-T2V-A14B's: its high-noise expert runs timesteps >= 875
    return cfg


def wan_i2v_config() -> dict[str, Any]:
    cfg = wan_config()
    cfg["i2v"] = True
    cfg["clip_vision"] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 224,
        "patch_size": 14,
    }
    cfg["transformer"] = {**cfg["transformer"], "in_channels": 36}
    return cfg


def _umt5_encoder(tokenizer: Any, cfg: dict[str, Any], generator: Any) -> Any:
    """``UMT5EncoderModel`` as umt5-xxl has it (gated GELU, untied, a relative bias in every layer)."""
    from transformers import UMT5Config, UMT5EncoderModel

    from vllm_omni_plugin.tiny_models.components import seeded_init

    model = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            **cfg,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            is_encoder_decoder=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )
    seeded_init(model, generator)
    return model.eval()


def _clip_vision(cfg: dict[str, Any], generator: Any) -> Any:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from vllm_omni_plugin.tiny_models.components import seeded_init

    model = CLIPVisionModel(CLIPVisionConfig(**cfg, hidden_act="gelu", projection_dim=cfg["hidden_size"]))
    seeded_init(model, generator)
    return model.eval()


def build_wan(outdir: Path, cfg: dict[str, Any]) -> None:
    """``WanPipeline``, or ``WanImageToVideoPipeline`` when ``cfg["i2v"]``; with ``cfg["boundary_ratio"]``
    (Wan 2.2's two experts) a second transformer, ``transformer_2``, drawn after every other weight (the
    one-expert kinds' weights stay what they were)."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )

    from vllm_omni_plugin.tiny_models.components import seeded_init, t5_tokenizer

    generator = torch.Generator().manual_seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])  # constructors draw from the global RNG; every weight is overwritten
    tokenizer = t5_tokenizer(**cfg["tokenizer"])
    text_encoder = _umt5_encoder(tokenizer, cfg["umt5"], generator)
    tr = cfg["transformer"]
    image: dict[str, int] = {}
    if cfg["i2v"]:  # as Wan2.1-I2V-14B: CLIP's width in, the transformer's own width for the added K/V
        inner = tr["num_attention_heads"] * tr["attention_head_dim"]
        image = {"image_dim": cfg["clip_vision"]["hidden_size"], "added_kv_proj_dim": inner}

    def new_transformer() -> Any:
        return WanTransformer3DModel(
            **{**tr, "patch_size": tuple(tr["patch_size"])}, text_dim=cfg["umt5"]["d_model"], **image
        )

    transformer = new_transformer()
    seeded_init(transformer, generator)
    z = cfg["vae"]["z_dim"]
    # Seeded per-channel statistics, not diffusers' defaults (the real ones): a pipeline that skips the
    # latent (de)normalisation then shows up as a mismatch.
    stats = torch.randn((2, z), generator=generator)
    vae = AutoencoderKLWan(
        **cfg["vae"],
        attn_scales=[],
        latents_mean=[round(float(x) * 0.5, 4) for x in stats[0]],
        latents_std=[round(1.0 + 0.5 * float(x.abs()), 4) for x in stats[1]],
    )
    seeded_init(vae, generator)
    experts: dict[str, Any] = {}
    if cfg.get("boundary_ratio") is not None:  # Wan 2.2 A14B: the low-noise expert, and where it takes over
        experts["transformer_2"] = new_transformer()
        seeded_init(experts["transformer_2"], generator)
        experts["transformer_2"].eval()
        experts["boundary_ratio"] = cfg["boundary_ratio"]
    scheduler = UniPCMultistepScheduler(
        num_train_timesteps=1000,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=cfg["scheduler"]["flow_shift"],
    )
    components: dict[str, Any] = {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "transformer": transformer.eval(),
        "vae": vae.eval(),
        "scheduler": scheduler,
    }
    if cfg["i2v"]:
        from transformers import CLIPImageProcessor

        pipe: Any = WanImageToVideoPipeline(
            **components,
            image_encoder=_clip_vision(cfg["clip_vision"], generator),
            image_processor=CLIPImageProcessor(),
        )
    else:
        pipe = WanPipeline(**components, **experts)
    pipe.save_pretrained(outdir, safe_serialization=True)
    if cfg["i2v"]:
        # Without torchvision transformers hands out CLIPImageProcessorPil: record the class the real
        # repository names (loading it falls back the same way).
        index_file = outdir / "model_index.json"
        index = json.loads(index_file.read_text())
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
        index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if cfg["i2v"]:
        name, kind = "Wan2.1 I2V", "wan-i2v"
    elif experts:
        name, kind = "Wan2.2 T2V A14B (two experts)", "wan2.2"
    else:
        name, kind = "Wan2.1 T2V", "wan"
    (outdir / "README.md").write_text(
        f"# tiny {name}\n\nRandom weights in the {type(pipe).__name__} layout, built offline by "
        f"`python -m vllm_omni_plugin.tiny_models {kind} OUTDIR`. For tests only: its videos are "
        "noise.\n"
    )
