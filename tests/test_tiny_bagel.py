"""The tiny BAGEL: hub layout, weight names and shapes as the spec lists them, deterministic, loadable."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from vllm_omni_plugin import tiny_models as tiny

pytestmark = pytest.mark.slow

SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|fim_middle|>",
)
HIDDEN, INTER, LAYERS, HEAD_DIM, KV_HEADS = 64, 128, 2, 32, 1
VIT_HIDDEN, VIT_INTER, VIT_CKPT_LAYERS = 32, 64, 2


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _expected_ema_shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    """Written out from the spec, independently of the builder's tables."""
    shapes: dict[str, tuple[int, ...]] = {
        "language_model.model.embed_tokens.weight": (vocab, HIDDEN),
        "language_model.lm_head.weight": (vocab, HIDDEN),
        "language_model.model.norm.weight": (HIDDEN,),
        "language_model.model.norm_moe_gen.weight": (HIDDEN,),
        "vit_model.vision_model.embeddings.patch_embedding.weight": (VIT_HIDDEN, 14 * 14 * 3),
        "vit_model.vision_model.embeddings.patch_embedding.bias": (VIT_HIDDEN,),
        "vit_model.vision_model.embeddings.position_embedding.weight": (64, VIT_HIDDEN),
        "vit_model.vision_model.post_layernorm.weight": (VIT_HIDDEN,),
        "vit_model.vision_model.post_layernorm.bias": (VIT_HIDDEN,),
        "connector.fc1.weight": (HIDDEN, VIT_HIDDEN),
        "connector.fc1.bias": (HIDDEN,),
        "connector.fc2.weight": (HIDDEN, HIDDEN),
        "connector.fc2.bias": (HIDDEN,),
        "vit_pos_embed.pos_embed": (8 * 8, HIDDEN),
        "latent_pos_embed.pos_embed": (8 * 8, HIDDEN),
        "time_embedder.mlp.0.weight": (HIDDEN, 256),
        "time_embedder.mlp.0.bias": (HIDDEN,),
        "time_embedder.mlp.2.weight": (HIDDEN, HIDDEN),
        "time_embedder.mlp.2.bias": (HIDDEN,),
        "vae2llm.weight": (HIDDEN, 64),
        "vae2llm.bias": (HIDDEN,),
        "llm2vae.weight": (64, HIDDEN),
        "llm2vae.bias": (64,),
    }
    for i in range(LAYERS):
        for s in ("", "_moe_gen"):
            p = f"language_model.model.layers.{i}"
            shapes |= {
                f"{p}.self_attn.q_proj{s}.weight": (2 * HEAD_DIM, HIDDEN),
                f"{p}.self_attn.q_proj{s}.bias": (2 * HEAD_DIM,),
                f"{p}.self_attn.k_proj{s}.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                f"{p}.self_attn.k_proj{s}.bias": (KV_HEADS * HEAD_DIM,),
                f"{p}.self_attn.v_proj{s}.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                f"{p}.self_attn.v_proj{s}.bias": (KV_HEADS * HEAD_DIM,),
                f"{p}.self_attn.o_proj{s}.weight": (HIDDEN, 2 * HEAD_DIM),
                f"{p}.self_attn.q_norm{s}.weight": (HEAD_DIM,),
                f"{p}.self_attn.k_norm{s}.weight": (HEAD_DIM,),
                f"{p}.mlp{s}.gate_proj.weight": (INTER, HIDDEN),
                f"{p}.mlp{s}.up_proj.weight": (INTER, HIDDEN),
                f"{p}.mlp{s}.down_proj.weight": (HIDDEN, INTER),
                f"{p}.input_layernorm{s}.weight": (HIDDEN,),
                f"{p}.post_attention_layernorm{s}.weight": (HIDDEN,),
            }
    for i in range(VIT_CKPT_LAYERS):
        p = f"vit_model.vision_model.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= {f"{p}.self_attn.{proj}.weight": (VIT_HIDDEN, VIT_HIDDEN)}
            shapes |= {f"{p}.self_attn.{proj}.bias": (VIT_HIDDEN,)}
        for norm in ("layer_norm1", "layer_norm2"):
            shapes |= {f"{p}.{norm}.weight": (VIT_HIDDEN,), f"{p}.{norm}.bias": (VIT_HIDDEN,)}
        shapes |= {f"{p}.mlp.fc1.weight": (VIT_INTER, VIT_HIDDEN), f"{p}.mlp.fc1.bias": (VIT_INTER,)}
        shapes |= {f"{p}.mlp.fc2.weight": (VIT_HIDDEN, VIT_INTER), f"{p}.mlp.fc2.bias": (VIT_HIDDEN,)}
    return shapes


def test_bagel_build_is_deterministic_small_and_cached(tmp_path: Path) -> None:
    a = tiny.build("bagel", tmp_path / "a")
    b = tiny.build("bagel", tmp_path / "b")
    files = _files(a)
    assert files == _files(b)
    assert set(files) >= {
        "config.json",
        "llm_config.json",
        "vit_config.json",
        "ema.safetensors",
        "ae.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert sum(len(data) for data in files.values()) < 8 * 2**20
    weights = a / "ema.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert tiny.build("bagel", a) == a  # cache hit: nothing rewritten
    assert weights.stat().st_mtime_ns == mtime


def test_bagel_configs_load_in_vllm_and_match_the_spec(tiny_bagel: Path) -> None:
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.bagel import BagelConfig

    config = get_config(str(tiny_bagel), trust_remote_code=False)
    assert isinstance(config, BagelConfig)
    assert config.architectures == ["BagelForConditionalGeneration"]
    assert (config.visual_gen, config.visual_und, config.interpolate_pos) == (True, True, False)
    assert (config.latent_patch_size, config.max_latent_size, config.vit_max_num_patch_per_side) == (2, 8, 8)
    assert (config.connector_act, config.timestep_shift) == ("gelu_pytorch_tanh", 1.0)
    llm = config.llm_config
    assert llm.model_type == "qwen2" and llm.hidden_size // llm.num_attention_heads == HEAD_DIM
    assert (llm.hidden_size, llm.intermediate_size, llm.num_hidden_layers) == (HIDDEN, INTER, LAYERS)
    assert (llm.num_attention_heads, llm.num_key_value_heads) == (2, KV_HEADS)
    assert (llm.qk_norm, llm.tie_word_embeddings, llm.layer_module) == (True, False, "Qwen2MoTDecoderLayer")
    assert llm.max_position_embeddings == 4096 and llm.rope_parameters["rope_theta"] == 1e6
    vit = config.vit_config
    assert vit.model_type == "siglip_vision_model"
    assert (vit.hidden_size, vit.intermediate_size, vit.num_attention_heads) == (32, 64, 2)
    assert (vit.num_hidden_layers, vit.patch_size, vit.image_size) == (3, 14, 112)
    assert vit.hidden_act == "gelu_pytorch_tanh"
    assert config.vae_config["z_channels"] == 16 and config.vae_config["downsample"] == 8
    assert config.vae_config["ch"] == 32 and config.vae_config["ch_mult"] == [1, 1, 1, 1]
    raw = json.loads((tiny_bagel / "config.json").read_text())
    assert raw["vae_transform"] == {"max_image_size": 128, "min_image_size": 32, "image_stride": 16}
    assert raw["vit_transform"] == {"max_image_size": 112, "min_image_size": 28, "image_stride": 14}
    assert raw["llm_config"] == json.loads((tiny_bagel / "llm_config.json").read_text())
    assert raw["vit_config"] == json.loads((tiny_bagel / "vit_config.json").read_text())


def test_bagel_tokenizer_has_the_special_tokens(tiny_bagel: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bagel)
    llm = json.loads((tiny_bagel / "llm_config.json").read_text())
    assert llm["vocab_size"] == len(tok)
    ids = tok.convert_tokens_to_ids(list(SPECIALS))
    assert len(set(ids)) == len(SPECIALS) and tok.unk_token_id not in ids
    for token, idx in zip(SPECIALS, ids, strict=True):
        assert tok.encode(f"a {token} b").count(idx) == 1  # one unsplittable token
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert (llm["eos_token_id"], llm["bos_token_id"]) == (ids[2], ids[0])
    text = "a red fox in the snow"
    assert tok.decode(tok.encode(text)) == text
    assert SPECIALS[1] not in tok.convert_ids_to_tokens(tok.encode(text))  # encode adds no specials


def test_bagel_weights_names_and_shapes(tiny_bagel: Path) -> None:
    import torch
    from safetensors.torch import load_file

    llm = json.loads((tiny_bagel / "llm_config.json").read_text())
    ema = load_file(tiny_bagel / "ema.safetensors")
    assert {k: tuple(v.shape) for k, v in ema.items()} == _expected_ema_shapes(llm["vocab_size"])
    assert all(v.dtype == torch.float32 for v in ema.values())
    index = json.loads((tiny_bagel / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == dict.fromkeys(ema, "ema.safetensors")

    # The experts differ, norms sit near 1, llm2vae is not the original's zero init.
    layer = "language_model.model.layers.0"
    for und, gen in (
        ("self_attn.q_proj", "self_attn.q_proj_moe_gen"),
        ("self_attn.k_norm", "self_attn.k_norm_moe_gen"),
        ("mlp.up_proj", "mlp_moe_gen.up_proj"),
        ("input_layernorm", "input_layernorm_moe_gen"),
    ):
        assert not torch.equal(ema[f"{layer}.{und}.weight"], ema[f"{layer}.{gen}.weight"])
    norm = ema[f"{layer}.input_layernorm.weight"]
    assert 0.5 < float(norm.min()) and float(norm.max()) < 1.5
    assert float(ema["llm2vae.weight"].abs().min()) > 0

    # The frozen sin-cos tables: first half of the channels encodes the column, second half the row.
    for name in ("vit_pos_embed.pos_embed", "latent_pos_embed.pos_embed"):
        table, quarter = ema[name], HIDDEN // 4
        omega = [1.0 / 10000 ** (k / quarter) for k in range(quarter)]
        for row, col in ((0, 0), (3, 5), (7, 2)):
            got = table[row * 8 + col]
            want = [math.sin(col * o) for o in omega] + [math.cos(col * o) for o in omega]
            want += [math.sin(row * o) for o in omega] + [math.cos(row * o) for o in omega]
            assert torch.allclose(got, torch.tensor(want), atol=1e-6)

    ae = load_file(tiny_bagel / "ae.safetensors")
    assert all(k.startswith(("encoder.", "decoder.")) for k in ae)
    expected_ae = {
        "encoder.conv_in.weight": (32, 3, 3, 3),
        "encoder.down.0.block.0.conv1.weight": (32, 32, 3, 3),
        "encoder.down.2.downsample.conv.weight": (32, 32, 3, 3),
        "encoder.mid.attn_1.q.weight": (32, 32, 1, 1),
        "encoder.conv_out.weight": (32, 32, 3, 3),  # 2 * z_channels: mean and log-variance
        "decoder.conv_in.weight": (32, 16, 3, 3),
        "decoder.up.3.block.1.norm2.weight": (32,),
        "decoder.up.1.upsample.conv.weight": (32, 32, 3, 3),
        "decoder.conv_out.weight": (3, 32, 3, 3),
    }
    assert {k: tuple(ae[k].shape) for k in expected_ae} == expected_ae
    assert "encoder.down.3.downsample.conv.weight" not in ae and "decoder.up.0.upsample.conv.weight" not in ae
    assert sum(k.startswith("encoder.down.") and k.endswith("conv1.weight") for k in ae) == 4  # 1 block/level
    assert sum(k.startswith("decoder.up.") and k.endswith("conv1.weight") for k in ae) == 8  # 2 blocks/level
