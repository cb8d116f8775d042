"""What the ``bagel`` pipeline sets in the thinker's vLLM ``EngineArgs`` (cheap: no vLLM import).

Configuration resolution calls :func:`thinker_engine_args` for stage 0 (``engine_args_provider``); the
values explain themselves in ``--print-resolved-config``.
"""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.models.bagel.config import load_bagel_config

ARCHITECTURE = "OmniBagelForConditionalGeneration"
"""Our thinker's architecture name: stock vLLM's ``BagelForConditionalGeneration`` stays with stock
vLLM's class (plain ``vllm serve`` of BAGEL is untouched); the pipeline selects ours."""


def mrope_section(head_dim: int) -> list[int]:
    """Three sections covering the rotary half of a head. BAGEL's positions have one axis; given three
    identical position rows, vLLM's M-RoPE is that 1-D RoPE whatever the split."""
    half = head_dim // 2
    side = half * 3 // 8
    return [half - 2 * side, side, side]


def thinker_engine_args(model_dir: str) -> dict[str, Any]:
    """``hf_overrides`` that select our architecture and carry BAGEL's block positions through M-RoPE
    (vLLM's only way to take positions a model computes), and ``disable_chunked_mm_input`` so that an
    image block is never split across steps (its rows attend to each other)."""
    cfg = load_bagel_config(model_dir)
    rope = {
        "rope_type": "default",
        "rope_theta": cfg.llm.rope_theta,
        "mrope_section": mrope_section(cfg.llm.head_dim),
    }
    return {
        "hf_overrides": {
            "architectures": [ARCHITECTURE],
            "rope_parameters": rope,
            "llm_config": {"rope_parameters": dict(rope), "qk_norm": True, "tie_word_embeddings": False},
        },
        "disable_chunked_mm_input": True,
    }
