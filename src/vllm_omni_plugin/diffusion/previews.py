"""Previews (``partial_images``) decoded beside the denoising instead of inside it.

A preview is a VAE decode of the clean image a step estimates. Made inline, a call's steps wait for it:
on the tiny SD3 three previews of a 28-step request made it 12% slower. A runner hands each preview's
decode to :class:`CallPreviews` instead; one worker thread per process decodes previews in the order
they were asked for, while the call's steps go on (on a CPU the decode takes another core; on a GPU its
kernels queue behind the step's on the same stream, and only the Python side overlaps). A call waits for
its previews before it returns, so every preview reaches the request's listener before its final image,
and a preview that fails fails the call as an inline one did. The worker decodes one preview at a time:
beside a step there is at most one preview decode's memory.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _preview_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dit-previews")
        return _pool


class CallPreviews:
    """The previews of one runner call: ``with CallPreviews() as previews: ... previews.decode(...)``;
    leaving the block waits for them (raising the first failure unless the block itself raised)."""

    def __init__(self) -> None:
        self._pending: list[concurrent.futures.Future[None]] = []

    def decode(
        self,
        make: Callable[[], list[Any]],
        asked: list[tuple[str, int]],
        sink: Callable[[str, int, Any], None],
    ) -> None:
        """On the preview thread, ``make()`` the images of ``asked`` ((request id, preview index) pairs,
        in order) and hand each to ``sink``. ``make`` must read only tensors no step changes later (an
        estimate computed for the preview, not the running latents)."""
        import torch

        def job() -> None:
            with torch.inference_mode():  # grad mode is per thread: the call's own does not reach here
                images = make()
            for (request_id, index), image in zip(asked, images, strict=True):
                sink(request_id, index, image)

        self._pending.append(_preview_pool().submit(job))

    def wait(self, *, raise_errors: bool = True) -> None:
        pending, self._pending = self._pending, []
        errors = []
        for future in pending:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - the first is raised below (or the call's own)
                errors.append(exc)
        if errors and raise_errors:
            raise errors[0]

    def __enter__(self) -> CallPreviews:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.wait(raise_errors=kind is None)
