"""Tiny random-weight models of the real architectures, for CPU trials and tests: built offline, seeded,
in seconds. ``builders``: the kinds, the config hash cache; ``__main__``: the command
``python -m vllm_omni_plugin.tiny_models KIND OUTDIR``; one module per family (``text``, ``glm_image``,
``bagel``, ``sd3``, ``flux``, ``qwen_image``) and the parts they share (``components``: the corpus,
tokenizers, encoders, VAE, the seeded init; ``lora``: adapters in diffusers' format; ``gguf_file``: a
denoiser as a GGUF checkpoint)."""

from __future__ import annotations

from vllm_omni_plugin.tiny_models.builders import BUILDERS, STAMP_FILE, build, config_hash

__all__ = ["BUILDERS", "STAMP_FILE", "build", "config_hash"]
