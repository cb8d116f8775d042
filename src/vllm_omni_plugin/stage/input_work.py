"""Work on a request's inputs that must not run on the API server's event loop: tokenizing prompts,
counting tokens, stage-input processing (BAGEL's processors tokenize; GLM-Image's token budget runs its
image processor). One request's large input would otherwise hold ``/health`` and every other request
until it is done.

It runs on one worker thread of its own: bounded (a flood of requests queues here, not in threads), and
one at a time because the fast tokenizers keep their padding and truncation settings per tokenizer object,
which two threads encoding at once would change under each other. What waits here is cheap: a prompt is
bounded in characters before it comes (``--image-max-prompt-chars``).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from vllm_omni_plugin.test_hooks import hold_point

T = TypeVar("T")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-input")
        return _pool


def _held(fn: Callable[..., T], *args: Any) -> T:
    hold_point("api.input", getattr(fn, "__name__", "input work"))
    return fn(*args)


async def input_work(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the input worker thread (see the module); tests can hold it there (``api.input``)."""
    return await asyncio.get_running_loop().run_in_executor(_executor(), functools.partial(_held, fn, *args))
