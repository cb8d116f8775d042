"""Tiny random-weight models of real architectures, built offline (``builders``: the kinds, the config
hash cache, the command), one module per family (``text``, ``glm_image``, ``bagel``, ``sd3``, ``flux``,
``qwen_image``) and the parts they share (``components``: the corpus, tokenizers, encoders, VAE, the
seeded init)."""

from __future__ import annotations

from vllm_omni_plugin.testing.tiny.builders import BUILDERS, STAMP_FILE, build, config_hash

__all__ = ["BUILDERS", "STAMP_FILE", "build", "config_hash"]
