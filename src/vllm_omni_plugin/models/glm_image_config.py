"""GLM-Image AR facts that configuration resolution and the family's processors need without importing the
model (cheap)."""

from __future__ import annotations

import json
import os
from typing import Any

EMBEDDING_ROWS_KEY = "embedding_vocab_size"
CODEBOOK_SIZE = 16384
"""AR ids 0..16383 are VQ codebook ids: what the AR may generate for an image and the DiT embeds."""
SOURCE_TOKEN_IDS = "source_token_ids"
"""The AR stage's output for image-to-image: per source image, its VQ ids on its d32 grid (row-major)."""
SOURCE_GRIDS = "source_grids"
"""And per source image its ``[t, h, w]`` d32 grid."""


def embedding_rows(text_config: Any) -> int:
    """Input-embedding rows: the text vocabulary, also when ``vocab_size`` was narrowed for sampling."""
    return int(getattr(text_config, EMBEDDING_ROWS_KEY, None) or text_config.vocab_size)


def sampling_vocab_overrides(model_dir: str) -> dict[str, Any]:
    """EngineArgs for the AR stage: ``hf_overrides`` that make vLLM sample over the LM head's ids only
    (16512, not the 168064-id text vocabulary), so the sampler's masks, sorts and logits cost a tenth;
    the embedding keeps its rows. Empty when the checkpoint's config cannot be read."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            text = json.load(f).get("text_config") or {}
        vocab, head = int(text["vocab_size"]), int(text["vision_vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    if head >= vocab:
        return {}
    return {"hf_overrides": {"text_config": {"vocab_size": head, EMBEDDING_ROWS_KEY: vocab}}}
