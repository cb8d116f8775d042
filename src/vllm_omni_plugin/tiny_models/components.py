"""Tokenizers, text encoders and autoencoders of the real classes at toy size, for the tiny diffusers
pipelines (SD3, FLUX, Qwen-Image).

Every tokenizer is learned from the fixed corpus below (so builds are deterministic and need
no download) and saved in the class the real checkpoints use: ``CLIPTokenizer`` (BPE with ``</w>`` word
ends, lower-cased), ``T5Tokenizer`` (unigram with ``▁`` word starts and 100 sentinels) and
``Qwen2Tokenizer`` (byte-level BPE with the ChatML and vision specials). Encoders take their weights from
:func:`seeded_init`, which every family's builder uses.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A small fixed corpus: the tokenizer's merges are learned from it, deterministically.
CORPUS_WORDS = (
    "the quick brown fox jumps over the lazy dog a red fox in the snow a photo of a cat "
    "hello world what is the capital of france paris is the capital of france one two three "
    "four five six seven eight nine ten image picture painting drawing of a mountain lake at "
    "sunset with trees and a small house on the shore generate an image please describe the "
    "scene in detail the sky is blue and the grass is green numbers 0 1 2 3 4 5 6 7 8 9 10 16 "
    "32 64 128 256 512 1024 system user assistant you are a helpful assistant"
).split()


def corpus() -> list[str]:
    lines = []
    n = len(CORPUS_WORDS)
    for i in range(400):
        lines.append(" ".join(CORPUS_WORDS[(i * 7 + j * 3) % n] for j in range(12)))
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
    tok.train_from_iterator(corpus(), trainer=trainer)
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


def seeded_init(model: Any, generator: Any, gain: float = 1.0) -> None:
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


CLIP_SPECIALS = ("<|startoftext|>", "<|endoftext|>")
T5_SPECIALS = ("<pad>", "</s>", "<unk>")
QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Qwen2.5-VL's specials that the Qwen-Image pipelines and processor use, at ids 0.. in this order."""


def _tokenizer_corpus(extra: tuple[str, ...] = ()) -> list[str]:
    import string

    # Every ASCII letter, digit and punctuation mark as a word of its own, and the words capitalised, so
    # prompts as people write them stay in vocabulary (no unknown token where a real tokenizer has none).
    characters = " ".join(string.ascii_letters + string.digits + string.punctuation)
    capitalised = " ".join(word.capitalize() for word in CORPUS_WORDS)
    return corpus() + [characters, capitalised] * 4 + list(extra)


def _merges(model: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def learn_bpe(words: Counter[tuple[str, ...]], vocab_size: int, base: list[str]) -> tuple[dict, list]:
    """Byte-pair merges over ``words`` (symbol tuples with counts) until the vocabulary has ``vocab_size``
    entries: always the most frequent pair, ties by the pair itself, so every process learns the same
    (``tokenizers``' trainer numbers word-end symbols in hash order, which differs between processes)."""
    vocab = {token: index for index, token in enumerate(dict.fromkeys(base))}
    merges: list[tuple[str, str]] = []
    words = Counter(words)
    while len(vocab) < vocab_size:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merged = best[0] + best[1]
        merges.append(best)
        vocab.setdefault(merged, len(vocab))
        new_words: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    return vocab, merges


def clip_tokenizer(vocab_size: int = 768, model_max_length: int = 77) -> Any:
    """A ``CLIPTokenizer`` learned with CLIP's own normalizer and pre-tokenizer: every byte alone and as
    a word end (``c</w>``), as in CLIP's vocabulary, then the merges."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    reference = CLIPTokenizer()  # CLIP's pipeline around an empty vocabulary: learn with exactly that
    normalizer = reference.backend_tokenizer.normalizer
    pre_tokenizer = reference.backend_tokenizer.pre_tokenizer
    words: Counter[tuple[str, ...]] = Counter()
    for line in _tokenizer_corpus():
        for word, _span in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(line)):
            words[(*word[:-1], word[-1] + "</w>")] += 1
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab, merges = learn_bpe(words, vocab_size, [*CLIP_SPECIALS, *alphabet, *(c + "</w>" for c in alphabet)])
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def t5_tokenizer(vocab_size: int = 400, model_max_length: int = 512) -> Any:
    """A ``T5Tokenizer``: a unigram model over T5's pre-tokenizer (``▁`` word starts) plus 100 sentinels.

    The pieces are every character and the most frequent whole words of the corpus, each scored by its
    log frequency, counted here rather than by ``tokenizers``' trainer, whose EM sums (and so scores and
    piece order) vary between processes.
    """
    import math

    from transformers import T5Tokenizer

    pre_tokenizer = T5Tokenizer().backend_tokenizer.pre_tokenizer
    words: Counter[str] = Counter()
    for line in _tokenizer_corpus():
        words.update(word for word, _span in pre_tokenizer.pre_tokenize_str(line))
    chars: Counter[str] = Counter()
    for word, count in words.items():
        for char in word:
            chars[char] += count
    room = vocab_size - len(T5_SPECIALS) - len(chars)
    whole = sorted((w for w in words if len(w) > 1), key=lambda w: (-words[w], w))[:room]
    counts = {**{c: chars[c] for c in sorted(chars)}, **{w: words[w] for w in whole}}
    total = sum(counts.values())
    pieces = sorted(counts, key=lambda piece: (-counts[piece], piece))
    vocab = [(token, 0.0) for token in T5_SPECIALS] + [(p, math.log(counts[p] / total)) for p in pieces]
    return T5Tokenizer(vocab=vocab, extra_ids=100, model_max_length=model_max_length)


def qwen2_tokenizer(vocab_size: int = 768, extra_text: tuple[str, ...] = ()) -> Any:
    """A ``Qwen2Tokenizer`` (byte-level BPE) with Qwen2.5-VL's ChatML and vision specials at ids 0..6;
    ``extra_text`` (e.g. a pipeline's prompt template) joins the corpus."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    reference = Qwen2Tokenizer()
    bpe = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix=""))
    bpe.normalizer = reference.backend_tokenizer.normalizer
    bpe.pre_tokenizer = reference.backend_tokenizer.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(QWEN_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tokenizer_corpus(extra_text), trainer=trainer)
    learned = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=learned["vocab"],
        merges=_merges(learned),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
        },
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    for index, token in enumerate(QWEN_SPECIALS):
        if tokenizer.convert_tokens_to_ids(token) != index:
            raise AssertionError(f"tiny Qwen2 tokenizer: {token} is not id {index}")
    return tokenizer


def clip_text_encoder(tokenizer: Any, cfg: dict[str, Any], generator: Any, *, with_projection: bool) -> Any:
    """``CLIPTextModel`` (FLUX's pooled text) or ``CLIPTextModelWithProjection`` (SD3's two encoders)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        projection_dim=cfg.get("projection_dim", cfg["hidden_size"]),
        max_position_embeddings=tokenizer.model_max_length,
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)
    seeded_init(model, generator)
    return model.eval()


def t5_encoder(tokenizer: Any, cfg: dict[str, Any], generator: Any) -> Any:
    """``T5EncoderModel`` (v1.1 style: gated GELU, untied)."""
    from transformers import T5Config, T5EncoderModel

    model = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=cfg["d_model"],
            d_ff=cfg["d_ff"],
            d_kv=cfg["d_kv"],
            num_layers=cfg["num_layers"],
            num_heads=cfg["num_heads"],
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            is_encoder_decoder=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    seeded_init(model, generator)
    return model.eval()


def autoencoder_kl(cfg: dict[str, Any], generator: Any) -> Any:
    """SD3's and FLUX's ``AutoencoderKL``: 16 latent channels, no (post-)quant convs, scale and shift."""
    from diffusers import AutoencoderKL

    blocks = tuple(cfg["block_out_channels"])
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(blocks),
        up_block_types=("UpDecoderBlock2D",) * len(blocks),
        block_out_channels=blocks,
        layers_per_block=cfg.get("layers_per_block", 1),
        latent_channels=cfg["latent_channels"],
        norm_num_groups=cfg["norm_num_groups"],
        sample_size=64,
        scaling_factor=cfg["scaling_factor"],
        shift_factor=cfg["shift_factor"],
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    seeded_init(vae, generator)
    return vae.eval()
