"""Loggers that live under vLLM's ``vllm`` logger tree, and the one way to run a step whose failure must
not stop its caller.

vLLM configures handlers, format and level (``VLLM_LOGGING_LEVEL``, ``VLLM_CONFIGURE_LOGGING``) on its
``vllm`` logger. Naming ours ``vllm.omni_plugin.*`` makes our lines look and filter like vLLM's, in
every process, without touching logging configuration ourselves.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

ROOT = "vllm.omni_plugin"


def get_logger(module_name: str) -> logging.Logger:
    suffix = module_name.removeprefix("vllm_omni_plugin").lstrip(".")
    return logging.getLogger(f"{ROOT}.{suffix}" if suffix else ROOT)


_logger = get_logger(__name__)


@contextlib.contextmanager
def best_effort(what: str, logger: logging.Logger | None = None, *, warn: bool = False) -> Iterator[None]:
    """Run the block and swallow any ``Exception`` it raises, logging ``what`` failed and why.

    For cleanup and courtesy messages whose failure the caller can live with (a peer that is gone, a
    lease that frees the memory anyway). At debug level, with the traceback, where failing is expected
    (the other end may be gone); ``warn`` where it leaves something behind. Cancellation and other
    ``BaseException`` pass."""
    try:
        yield
    except Exception as exc:
        level = logging.WARNING if warn else logging.DEBUG
        (logger or _logger).log(level, "%s failed: %s: %s", what, type(exc).__name__, exc, exc_info=not warn)
