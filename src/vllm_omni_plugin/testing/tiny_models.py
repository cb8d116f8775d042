"""Tiny random-weight models of real architectures, built offline.

``python -m vllm_omni_plugin.testing.tiny_models KIND OUTDIR`` writes a model directory that vLLM,
transformers and diffusers load like the real thing. Builds are seeded and deterministic (the same
kind and config give byte-identical files) and cached by config hash: OUTDIR keeps a stamp with the
hash, and a second build with the same hash returns at once.

Every attention layer has head_dim 32, the smallest head size vLLM's CPU attention supports (vLLM's
Qwen2 derives head_dim as hidden_size / num_attention_heads).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def build_chat_tokenizer(outdir: Path, vocab_size: int = 1024) -> int:
    """A byte-level BPE tokenizer with ChatML specials and a chat template; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
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
        model_max_length=512,
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


BUILDERS: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[Path, dict[str, Any]], None]]] = {
    "text": (_text_config, build_text),
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
