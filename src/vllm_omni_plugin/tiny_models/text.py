"""The tiny text model: a Qwen2ForCausalLM with a ChatML tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_omni_plugin.tiny_models.components import build_chat_tokenizer


def text_config() -> dict[str, Any]:
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
