"""Loggers that live under vLLM's ``vllm`` logger tree.

vLLM configures handlers, format and level (``VLLM_LOGGING_LEVEL``, ``VLLM_CONFIGURE_LOGGING``) on its
``vllm`` logger. Naming ours ``vllm.omni_plugin.*`` makes our lines look and filter like vLLM's, in
every process, without touching logging configuration ourselves.
"""

from __future__ import annotations

import logging

ROOT = "vllm.omni_plugin"


def get_logger(module_name: str) -> logging.Logger:
    suffix = module_name.removeprefix("vllm_omni_plugin").lstrip(".")
    return logging.getLogger(f"{ROOT}.{suffix}" if suffix else ROOT)
