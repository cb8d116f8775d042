"""Tiny Qwen-Image (``QwenImagePipeline``) and Qwen-Image-Edit (``QwenImageEditPipeline``), random weights.

The real component classes at toy size: ``QwenImageTransformer2DModel`` (MMDiT with 3-axis RoPE over the
packed 2x2 latent patches), ``AutoencoderKLQwenImage`` (the causal 3-D VAE, scale factor 8, 16 latent
channels), ``Qwen2_5_VLForConditionalGeneration`` as the text encoder (its vision tower reads the source
image of an edit) with a ``Qwen2Tokenizer``, the ``FlowMatchEulerDiscreteScheduler`` with dynamic shift,
and for the edit pipeline a ``Qwen2VLProcessor``.

The pipelines drop the first tokens of their prompt template's hidden states (34, resp. 64) because that is
where the real tokenizer ends the system prompt. The tiny tokenizer learns the template words so that the
system prompt comes to the same token count, checked at build time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEXT_HIDDEN = 64


def qwen_image_config(edit: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "seed": 0,
        "edit": edit,
        "text": {
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,  # head_dim 32: M-RoPE sections sum to 16
            "num_key_value_heads": 1,
            "mrope_section": [4, 6, 6],
            "rope_theta": 1000000.0,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
        },
        "vision": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 1,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        # The processor shrinks a source image to at most 4 x 4 patches of 28 pixels (16 image tokens
        # after the 2x2 merge) whatever size the pipeline hands it.
        "processor": {"min_pixels": 56 * 56, "max_pixels": 112 * 112},
        "transformer": {
            "patch_size": 2,
            "in_channels": 64,
            "out_channels": 16,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "axes_dims_rope": [4, 6, 6],
        },
        "vae": {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1},
        "scheduler": {
            "base_shift": 0.5,
            "max_shift": 0.9,
            "base_image_seq_len": 256,
            "max_image_seq_len": 8192,
            "shift_terminal": 0.02,
        },
    }
    return cfg


def qwen_image_edit_config() -> dict[str, Any]:
    return qwen_image_config(edit=True)


def _templates() -> list[tuple[str, int]]:
    """Each pipeline's prompt template and how many leading tokens it drops (read from diffusers)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImagePipeline

    out = []
    for cls, extra in ((QwenImagePipeline, {}), (QwenImageEditPipeline, {"processor": None})):
        empty = cls(
            scheduler=FlowMatchEulerDiscreteScheduler(),
            vae=None,
            text_encoder=None,
            tokenizer=None,
            transformer=None,
            **extra,
        )
        out.append((empty.prompt_template_encode, empty.prompt_template_encode_start_idx))
    return out


def _tokenizer() -> Any:
    from vllm_omni_plugin.tiny_models.components import qwen2_tokenizer

    templates = _templates()
    tokenizer = qwen2_tokenizer(extra_text=tuple(t.format("") for t, _ in templates) * 20)
    for template, drop in templates:
        prefix = template.split("{}")[0]
        prefix = prefix[: prefix.rindex("user\n") + len("user\n")]
        count = len(tokenizer(prefix).input_ids)
        if count != drop:
            raise AssertionError(f"tiny Qwen2 tokenizer: the system prompt takes {count} tokens, not {drop}")
    return tokenizer


def _text_encoder(tokenizer: Any, cfg: dict[str, Any], generator: Any) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from vllm_omni_plugin.tiny_models.components import seeded_init

    t, v = cfg["text"], cfg["vision"]
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in _VISION_TOKENS.items()}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": t["hidden_size"],
            "intermediate_size": t["intermediate_size"],
            "num_hidden_layers": t["num_hidden_layers"],
            "num_attention_heads": t["num_attention_heads"],
            "num_key_value_heads": t["num_key_value_heads"],
            "max_position_embeddings": t["max_position_embeddings"],
            "rms_norm_eps": t["rms_norm_eps"],
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": t["rope_theta"],
                "mrope_section": list(t["mrope_section"]),
            },
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={**v, "out_hidden_size": t["hidden_size"], "in_channels": 3},
        **ids,
    )
    model = Qwen2_5_VLForConditionalGeneration(config)
    seeded_init(model, generator)
    return model.eval()


_VISION_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def build_qwen_image(outdir: Path, cfg: dict[str, Any]) -> None:
    """``QwenImagePipeline``, or ``QwenImageEditPipeline`` when ``cfg["edit"]``."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    from vllm_omni_plugin.tiny_models.components import seeded_init

    generator = torch.Generator().manual_seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])  # constructors draw from the global RNG; every weight is overwritten
    tokenizer = _tokenizer()
    text_encoder = _text_encoder(tokenizer, cfg, generator)
    tr = cfg["transformer"]
    transformer = QwenImageTransformer2DModel(
        **{**tr, "axes_dims_rope": tuple(tr["axes_dims_rope"])},
        joint_attention_dim=cfg["text"]["hidden_size"],
        guidance_embeds=False,
    )
    seeded_init(transformer, generator)
    z = cfg["vae"]["z_dim"]
    stats = torch.randn((2, z), generator=generator)
    vae = AutoencoderKLQwenImage(
        **cfg["vae"],
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=[round(float(x) * 0.5, 4) for x in stats[0]],
        latents_std=[round(1.0 + 0.5 * float(x.abs()), 4) for x in stats[1]],
    )
    seeded_init(vae, generator)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        time_shift_type="exponential",
        **cfg["scheduler"],
    )
    components: dict[str, Any] = {
        "scheduler": scheduler,
        "vae": vae.eval(),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer.eval(),
    }
    if cfg["edit"]:
        pipe: Any = QwenImageEditPipeline(**components, processor=None)
    else:
        pipe = QwenImagePipeline(**components)
    pipe.save_pretrained(outdir, safe_serialization=True)
    if cfg["edit"]:
        _save_processor(outdir, tokenizer, cfg)
    name, kind = ("Qwen-Image-Edit", "qwen-image-edit") if cfg["edit"] else ("Qwen-Image", "qwen-image")
    (outdir / "README.md").write_text(
        f"# tiny {name}\n\nRandom weights in the {type(pipe).__name__} layout, built offline by "
        f"`python -m vllm_omni_plugin.tiny_models {kind} OUTDIR`. For tests only: its images are "
        "noise.\n"
    )


def _save_processor(outdir: Path, tokenizer: Any, cfg: dict[str, Any]) -> None:
    """The edit pipeline's ``processor/`` as the real repository has it (``Qwen2VLProcessor``: tokenizer,
    image and video processor configs), written without constructing a ``Qwen2VLProcessor``, which needs
    torchvision for its video processor."""
    from transformers import Qwen2VLImageProcessorPil

    v, p = cfg["vision"], cfg["processor"]
    folder = outdir / "processor"
    tokenizer.save_pretrained(folder)
    sizes = {
        "patch_size": v["patch_size"],
        "temporal_patch_size": v["temporal_patch_size"],
        "merge_size": v["spatial_merge_size"],
        "min_pixels": p["min_pixels"],
        "max_pixels": p["max_pixels"],
    }
    Qwen2VLImageProcessorPil(**sizes).save_pretrained(folder)
    image_config = json.loads((folder / "preprocessor_config.json").read_text())
    image_config.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor")
    (folder / "preprocessor_config.json").write_text(
        json.dumps(image_config, indent=2, sort_keys=True) + "\n"
    )
    video_config = {
        **{k: image_config[k] for k in ("do_convert_rgb", "do_normalize", "do_rescale", "do_resize")},
        **{k: image_config[k] for k in ("image_mean", "image_std", "rescale_factor", "resample", "size")},
        **sizes,
        "video_processor_type": "Qwen2VLVideoProcessor",
        "processor_class": "Qwen2VLProcessor",
    }
    (folder / "video_preprocessor_config.json").write_text(
        json.dumps(video_config, indent=2, sort_keys=True) + "\n"
    )
    index_file = outdir / "model_index.json"
    index = json.loads(index_file.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
