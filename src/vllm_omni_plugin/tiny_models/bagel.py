"""The tiny BAGEL (ByteDance-Seed/BAGEL-7B-MoT layout at toy size), for ``tiny_models bagel OUTDIR``.

Files, as on the hub: ``config.json`` (``model_type: bagel`` with nested ``llm_config``, ``vit_config``,
``vae_config``), ``llm_config.json``, ``vit_config.json``, ``ema.safetensors`` (both MoT experts, the NaViT
SigLIP, connector, generation heads, the frozen sin-cos tables), ``model.safetensors.index.json`` (maps every
``ema`` weight, so weight loaders that honour it skip the autoencoder file), ``ae.safetensors`` (FLUX
autoencoder, BFL names) and a byte-level BPE tokenizer with Qwen2's special tokens.

Two deliberate, documented extensions of the original's config: ``vae_config`` carries the FLUX autoencoder
parameters, and ``vae_transform`` / ``vit_transform`` carry the image-transform sizes, so a tiny model can use
tiny images. The ViT config says 3 layers and the checkpoint holds 2, like the hub (27 vs 26): every loader
runs ``num_hidden_layers - 1`` layers.

All weights are random but matter: the two experts differ, norms sit near 1, ``llm2vae`` (zero in the
original's init) is random, and the scales keep activations O(1), so images depend on the prompt, the input
image, the seed and the CFG scales.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BAGEL_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|fim_middle|>",
)


def bagel_config() -> dict[str, Any]:
    """The builder's inputs (hashed into the cache stamp)."""
    return {
        "seed": 0,
        "tokenizer_vocab_size": 1024,
        "llm": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,  # head_dim 32
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
        },
        "vit": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 3,  # the checkpoint holds 2 (loaders run num_hidden_layers - 1)
            "patch_size": 14,
            "image_size": 112,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
        },
        "vae": {
            "resolution": 256,
            "in_channels": 3,
            "downsample": 8,
            "ch": 32,
            "out_ch": 3,
            "ch_mult": [1, 1, 1, 1],
            "num_res_blocks": 1,
            "z_channels": 16,
            "scale_factor": 0.3611,
            "shift_factor": 0.1159,
        },
        "latent_patch_size": 2,
        "max_latent_size": 8,
        "vit_max_num_patch_per_side": 8,
        "timestep_shift": 1.0,
        "vae_transform": {"max_image_size": 128, "min_image_size": 32, "image_stride": 16},
        "vit_transform": {"max_image_size": 112, "min_image_size": 28, "image_stride": 14},
        # Random-weight scales: matrices N(0, gain^2 / fan_in); norm weights 1 + N(0, norm_jitter^2);
        # biases N(0, bias_std^2).
        "init": {
            "gain": 1.0,
            "lm_head_gain": 3.0,
            "embed_std": 1.0,
            "vit_pos_std": 0.5,
            "vae_out_gain": 0.7,
            "norm_jitter": 0.1,
            "bias_std": 0.1,
        },
    }


def sincos_pos_embed_2d(embed_dim: int, grid_size: int) -> Any:
    """BAGEL's frozen 2-D sin-cos table ``[grid_size**2, embed_dim]`` (row-major, h half then w half)."""
    import numpy as np
    import torch

    def one_axis(dim: int, pos: Any) -> Any:
        omega = np.arange(dim // 2, dtype=np.float64)
        omega /= dim / 2.0
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    axis = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(axis, axis), axis=0).reshape(2, 1, grid_size, grid_size)  # w first
    table = np.concatenate([one_axis(embed_dim // 2, grid[0]), one_axis(embed_dim // 2, grid[1])], axis=1)
    return torch.from_numpy(table).float()


def _llm_weight_shapes(cfg: dict[str, Any], vocab: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``name -> (kind, shape)`` for the language model; kind picks the initialiser."""
    llm = cfg["llm"]
    hidden, inter = llm["hidden_size"], llm["intermediate_size"]
    head_dim = hidden // llm["num_attention_heads"]
    q_out, kv_out = llm["num_attention_heads"] * head_dim, llm["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {
        "language_model.model.embed_tokens.weight": ("embed", (vocab, hidden)),
        "language_model.lm_head.weight": ("lm_head", (vocab, hidden)),
    }
    for suffix in ("", "_moe_gen"):
        shapes[f"language_model.model.norm{suffix}.weight"] = ("norm", (hidden,))
        for i in range(llm["num_hidden_layers"]):
            p = f"language_model.model.layers.{i}"
            for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                shapes[f"{p}.self_attn.{proj}{suffix}.weight"] = ("matrix", (out, hidden))
                shapes[f"{p}.self_attn.{proj}{suffix}.bias"] = ("bias", (out,))
            shapes[f"{p}.self_attn.o_proj{suffix}.weight"] = ("matrix", (hidden, q_out))
            shapes[f"{p}.self_attn.q_norm{suffix}.weight"] = ("norm", (head_dim,))
            shapes[f"{p}.self_attn.k_norm{suffix}.weight"] = ("norm", (head_dim,))
            shapes[f"{p}.mlp{suffix}.gate_proj.weight"] = ("matrix", (inter, hidden))
            shapes[f"{p}.mlp{suffix}.up_proj.weight"] = ("matrix", (inter, hidden))
            shapes[f"{p}.mlp{suffix}.down_proj.weight"] = ("matrix", (hidden, inter))
            shapes[f"{p}.input_layernorm{suffix}.weight"] = ("norm", (hidden,))
            shapes[f"{p}.post_attention_layernorm{suffix}.weight"] = ("norm", (hidden,))
    return shapes


def _vision_and_head_shapes(cfg: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ViT, connector and generation heads (the sin-cos tables are added separately)."""
    vit, hidden = cfg["vit"], cfg["llm"]["hidden_size"]
    vh, vi = vit["hidden_size"], vit["intermediate_size"]
    patch_dim = vit["patch_size"] ** 2 * vit["num_channels"]
    num_positions = (vit["image_size"] // vit["patch_size"]) ** 2
    latent_dim = cfg["latent_patch_size"] ** 2 * cfg["vae"]["z_channels"]
    e = "vit_model.vision_model"
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {
        f"{e}.embeddings.patch_embedding.weight": ("matrix", (vh, patch_dim)),
        f"{e}.embeddings.patch_embedding.bias": ("bias", (vh,)),
        f"{e}.embeddings.position_embedding.weight": ("vit_pos", (num_positions, vh)),
        f"{e}.post_layernorm.weight": ("norm", (vh,)),
        f"{e}.post_layernorm.bias": ("bias", (vh,)),
        "connector.fc1.weight": ("matrix", (hidden, vh)),
        "connector.fc1.bias": ("bias", (hidden,)),
        "connector.fc2.weight": ("matrix", (hidden, hidden)),
        "connector.fc2.bias": ("bias", (hidden,)),
        "time_embedder.mlp.0.weight": ("matrix", (hidden, 256)),
        "time_embedder.mlp.0.bias": ("bias", (hidden,)),
        "time_embedder.mlp.2.weight": ("matrix", (hidden, hidden)),
        "time_embedder.mlp.2.bias": ("bias", (hidden,)),
        "vae2llm.weight": ("matrix", (hidden, latent_dim)),
        "vae2llm.bias": ("bias", (hidden,)),
        "llm2vae.weight": ("matrix", (latent_dim, hidden)),
        "llm2vae.bias": ("bias", (latent_dim,)),
    }
    for i in range(vit["num_hidden_layers"] - 1):  # the checkpoint drops the config's last layer
        p = f"{e}.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{p}.self_attn.{proj}.weight"] = ("matrix", (vh, vh))
            shapes[f"{p}.self_attn.{proj}.bias"] = ("bias", (vh,))
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{p}.{norm}.weight"] = ("norm", (vh,))
            shapes[f"{p}.{norm}.bias"] = ("bias", (vh,))
        shapes[f"{p}.mlp.fc1.weight"] = ("matrix", (vi, vh))
        shapes[f"{p}.mlp.fc1.bias"] = ("bias", (vi,))
        shapes[f"{p}.mlp.fc2.weight"] = ("matrix", (vh, vi))
        shapes[f"{p}.mlp.fc2.bias"] = ("bias", (vh,))
    return shapes


def ema_weight_shapes(cfg: dict[str, Any], vocab: int) -> dict[str, tuple[int, ...]]:
    """Every ``ema.safetensors`` name and shape (what tests check the build against)."""
    hidden = cfg["llm"]["hidden_size"]
    shapes = {name: shape for name, (_, shape) in _llm_weight_shapes(cfg, vocab).items()}
    shapes.update({name: shape for name, (_, shape) in _vision_and_head_shapes(cfg).items()})
    shapes["vit_pos_embed.pos_embed"] = (cfg["vit_max_num_patch_per_side"] ** 2, hidden)
    shapes["latent_pos_embed.pos_embed"] = (cfg["max_latent_size"] ** 2, hidden)
    return shapes


def _resnet_shapes(prefix: str, cin: int, cout: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {
        f"{prefix}.norm1.weight": ("norm", (cin,)),
        f"{prefix}.norm1.bias": ("bias", (cin,)),
        f"{prefix}.conv1.weight": ("matrix", (cout, cin, 3, 3)),
        f"{prefix}.conv1.bias": ("bias", (cout,)),
        f"{prefix}.norm2.weight": ("norm", (cout,)),
        f"{prefix}.norm2.bias": ("bias", (cout,)),
        f"{prefix}.conv2.weight": ("matrix", (cout, cout, 3, 3)),
        f"{prefix}.conv2.bias": ("bias", (cout,)),
    }
    if cin != cout:
        shapes[f"{prefix}.nin_shortcut.weight"] = ("matrix", (cout, cin, 1, 1))
        shapes[f"{prefix}.nin_shortcut.bias"] = ("bias", (cout,))
    return shapes


def _attn_shapes(prefix: str, ch: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {
        f"{prefix}.norm.weight": ("norm", (ch,)),
        f"{prefix}.norm.bias": ("bias", (ch,)),
    }
    for conv in ("q", "k", "v", "proj_out"):
        shapes[f"{prefix}.{conv}.weight"] = ("matrix", (ch, ch, 1, 1))
        shapes[f"{prefix}.{conv}.bias"] = ("bias", (ch,))
    return shapes


def _ae_weight_kinds(vae: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The FLUX autoencoder (BFL names: ``encoder.down.{i}.block.{j}``, ``decoder.up.{i}``, ``mid``)."""
    ch, mult, nres, z = vae["ch"], list(vae["ch_mult"]), vae["num_res_blocks"], vae["z_channels"]
    levels = len(mult)
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {
        "encoder.conv_in.weight": ("matrix", (ch, vae["in_channels"], 3, 3)),
        "encoder.conv_in.bias": ("bias", (ch,)),
    }
    in_mult = [1, *mult]
    block_in = ch
    for i in range(levels):
        block_in, block_out = ch * in_mult[i], ch * mult[i]
        for j in range(nres):
            shapes.update(_resnet_shapes(f"encoder.down.{i}.block.{j}", block_in, block_out))
            block_in = block_out
        if i != levels - 1:
            shapes[f"encoder.down.{i}.downsample.conv.weight"] = ("matrix", (block_in, block_in, 3, 3))
            shapes[f"encoder.down.{i}.downsample.conv.bias"] = ("bias", (block_in,))
    shapes.update(_resnet_shapes("encoder.mid.block_1", block_in, block_in))
    shapes.update(_attn_shapes("encoder.mid.attn_1", block_in))
    shapes.update(_resnet_shapes("encoder.mid.block_2", block_in, block_in))
    shapes["encoder.norm_out.weight"] = ("norm", (block_in,))
    shapes["encoder.norm_out.bias"] = ("bias", (block_in,))
    shapes["encoder.conv_out.weight"] = ("matrix", (2 * z, block_in, 3, 3))
    shapes["encoder.conv_out.bias"] = ("bias", (2 * z,))

    block_in = ch * mult[-1]
    shapes["decoder.conv_in.weight"] = ("matrix", (block_in, z, 3, 3))
    shapes["decoder.conv_in.bias"] = ("bias", (block_in,))
    shapes.update(_resnet_shapes("decoder.mid.block_1", block_in, block_in))
    shapes.update(_attn_shapes("decoder.mid.attn_1", block_in))
    shapes.update(_resnet_shapes("decoder.mid.block_2", block_in, block_in))
    for i in reversed(range(levels)):
        block_out = ch * mult[i]
        for j in range(nres + 1):
            shapes.update(_resnet_shapes(f"decoder.up.{i}.block.{j}", block_in, block_out))
            block_in = block_out
        if i != 0:
            shapes[f"decoder.up.{i}.upsample.conv.weight"] = ("matrix", (block_in, block_in, 3, 3))
            shapes[f"decoder.up.{i}.upsample.conv.bias"] = ("bias", (block_in,))
    shapes["decoder.norm_out.weight"] = ("norm", (block_in,))
    shapes["decoder.norm_out.bias"] = ("bias", (block_in,))
    shapes["decoder.conv_out.weight"] = ("vae_out", (vae["out_ch"], block_in, 3, 3))
    shapes["decoder.conv_out.bias"] = ("bias", (vae["out_ch"],))
    return shapes


def ae_weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every ``ae.safetensors`` name and shape."""
    return {name: shape for name, (_, shape) in _ae_weight_kinds(cfg["vae"]).items()}


def _draw(kinds: dict[str, tuple[str, tuple[int, ...]]], init: dict[str, Any], generator: Any) -> dict:
    """One tensor per name, drawn from ``generator`` in sorted-name order."""
    import torch

    tensors = {}
    for name in sorted(kinds):
        kind, shape = kinds[name]
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        fan_in = 1
        for dim in shape[1:]:
            fan_in *= dim
        if kind == "matrix":
            value = noise * (init["gain"] / fan_in**0.5)
        elif kind == "lm_head":
            value = noise * (init["lm_head_gain"] / fan_in**0.5)
        elif kind == "vae_out":
            value = noise * (init["vae_out_gain"] / fan_in**0.5)
        elif kind == "embed":
            value = noise * init["embed_std"]
        elif kind == "vit_pos":
            value = noise * init["vit_pos_std"]
        elif kind == "norm":
            value = 1.0 + init["norm_jitter"] * noise
        elif kind == "bias":
            value = init["bias_std"] * noise
        else:  # pragma: no cover - a typo in the tables above
            raise ValueError(f"unknown weight kind {kind!r} for {name}")
        tensors[name] = value.contiguous()
    return tensors


def _llm_config_json(cfg: dict[str, Any], vocab: int, token_ids: dict[str, int]) -> dict[str, Any]:
    llm = cfg["llm"]
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": llm["hidden_size"],
        "intermediate_size": llm["intermediate_size"],
        "num_hidden_layers": llm["num_hidden_layers"],
        "num_attention_heads": llm["num_attention_heads"],
        "num_key_value_heads": llm["num_key_value_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": llm["max_position_embeddings"],
        "max_window_layers": llm["num_hidden_layers"],
        "rope_theta": llm["rope_theta"],
        "rms_norm_eps": llm["rms_norm_eps"],
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "qk_norm": True,
        "tie_word_embeddings": False,
        "layer_module": "Qwen2MoTDecoderLayer",
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "pad_token_id": token_ids["<|endoftext|>"],
        "torch_dtype": "float32",
    }


def _vit_config_json(cfg: dict[str, Any]) -> dict[str, Any]:
    vit = cfg["vit"]
    return {
        "model_type": "siglip_vision_model",
        "hidden_size": vit["hidden_size"],
        "intermediate_size": vit["intermediate_size"],
        "num_attention_heads": vit["num_attention_heads"],
        "num_hidden_layers": vit["num_hidden_layers"],
        "num_channels": vit["num_channels"],
        "patch_size": vit["patch_size"],
        "image_size": vit["image_size"],
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": vit["layer_norm_eps"],
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_bagel(outdir: Path, cfg: dict[str, Any]) -> None:
    """Write the tiny BAGEL into ``outdir`` (called by ``builders.build``)."""
    import torch
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    from vllm_omni_plugin.tiny_models.components import build_chat_tokenizer

    vocab = build_chat_tokenizer(
        outdir,
        cfg["tokenizer_vocab_size"],
        specials=BAGEL_SPECIAL_TOKENS,
        model_max_length=cfg["llm"]["max_position_embeddings"],
    )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(outdir)
    token_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in BAGEL_SPECIAL_TOKENS}

    generator = torch.Generator().manual_seed(cfg["seed"])
    kinds = _llm_weight_shapes(cfg, vocab)
    kinds.update(_vision_and_head_shapes(cfg))
    ema = _draw(kinds, cfg["init"], generator)
    hidden = cfg["llm"]["hidden_size"]
    ema["vit_pos_embed.pos_embed"] = sincos_pos_embed_2d(hidden, cfg["vit_max_num_patch_per_side"])
    ema["latent_pos_embed.pos_embed"] = sincos_pos_embed_2d(hidden, cfg["max_latent_size"])
    ae = _draw(_ae_weight_kinds(cfg["vae"]), cfg["init"], generator)

    metadata = {"format": "pt"}
    save_file(ema, str(outdir / "ema.safetensors"), metadata=metadata)
    save_file(ae, str(outdir / "ae.safetensors"), metadata=metadata)
    total = sum(t.numel() * t.element_size() for t in ema.values())
    _write_json(
        outdir / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": {name: "ema.safetensors" for name in sorted(ema)}},
    )

    llm_config = _llm_config_json(cfg, vocab, token_ids)
    vit_config = _vit_config_json(cfg)
    _write_json(outdir / "llm_config.json", llm_config)
    _write_json(outdir / "vit_config.json", vit_config)
    _write_json(
        outdir / "config.json",
        {
            "model_type": "bagel",
            "architectures": ["BagelForConditionalGeneration"],
            "visual_gen": True,
            "visual_und": True,
            "llm_config": llm_config,
            "vit_config": vit_config,
            "vae_config": dict(cfg["vae"]),
            "latent_patch_size": cfg["latent_patch_size"],
            "max_latent_size": cfg["max_latent_size"],
            "vit_max_num_patch_per_side": cfg["vit_max_num_patch_per_side"],
            "connector_act": "gelu_pytorch_tanh",
            "interpolate_pos": False,
            "timestep_shift": cfg["timestep_shift"],
            "vae_transform": dict(cfg["vae_transform"]),
            "vit_transform": dict(cfg["vit_transform"]),
            "torch_dtype": "float32",
        },
    )
    (outdir / "README.md").write_text(
        "# tiny BAGEL\n\nRandom weights, ByteDance-Seed/BAGEL-7B-MoT layout, built offline by "
        "`python -m vllm_omni_plugin.tiny_models bagel OUTDIR`. For tests only: its text and "
        "images are noise.\n"
    )
