"""Previews (``partial_images``) decoded beside the denoising instead of inside it.

A preview is a VAE decode of the clean image a step estimates. Made inline, a call's steps wait for it:
on the tiny SD3 three previews of a 28-step request made it 12% slower. A runner hands each preview's
decode to :class:`CallPreviews` instead; one worker thread per process decodes previews in the order
they were asked for, while the call's steps go on (on a CPU the decode takes another core; on a GPU its
kernels queue behind the step's on the same stream, and only the Python side overlaps). A call waits for
its previews before it returns, so every preview reaches the request's listener before its final image,
and a preview that fails fails the call as an inline one did. The worker decodes one preview at a time:
beside a step there is at most one preview decode's memory.

In the step loop the same thread decodes them, from :class:`PreviewLayer`, the previews' layer of a
family's pieces.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from vllm_omni_plugin.diffusion.runner import PreviewCallback, preview_steps
from vllm_omni_plugin.diffusion.step_loop import LoopLayer

logger = logging.getLogger(__name__)

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


class PreviewLayer(LoopLayer):
    """Previews in the step loop: after the steps a request asked previews for (spread as
    :func:`preview_steps` spreads them), the clean image its step estimates (the family's ``estimate``:
    flow matching's ``sample - sigma * output``, BAGEL's ``x - t * v``) is decoded by the family's own
    decoder on the preview thread while the next steps run. The loop decodes finished requests only once
    their previews are out, so each preview reaches its listener before the final image."""

    field = "partial_images"

    def __init__(
        self,
        decode: Callable[[list[Any]], list[Any]],
        steps: Callable[[Any], int],
        estimate: Callable[[Any, Any, Any], Any],
        sink: Callable[[], PreviewCallback | None],
    ) -> None:
        self.decode = decode
        self.estimate = estimate
        """The family's decoder of states (an estimate decodes as a copy of its state)."""
        self.steps = steps
        self.sink = sink
        """Where previews go, read when a request is admitted (None: nobody listens, none is made)."""
        self.wanted: dict[Any, tuple[str, dict[int, int], PreviewCallback]] = {}
        """Each admitted state that asked: its request, preview index by step, and its listener."""
        self.pending = CallPreviews()

    def admit(self, request: Any, state: Any) -> None:
        sink = self.sink()
        if request.partial_images and sink is not None:
            at = preview_steps(request.partial_images, self.steps(state))
            self.wanted[state] = (request.request_id, {step: k for k, step in enumerate(at)}, sink)

    def leave(self, state: Any) -> None:
        self.wanted.pop(state, None)

    def stepped(self, state: Any, sample: Any, output: Any) -> None:
        asked = self.wanted.get(state)
        index = None if asked is None else asked[1].get(state.index)
        if asked is None or index is None:
            return
        clean = self.estimate(state, sample, output)
        estimate = dataclasses.replace(state, latents=clean)  # a copy: the running state steps on
        self.pending.decode(lambda: self.decode([estimate]), [(asked[0], index)], asked[2])

    def settle(self) -> None:
        """Wait for the previews asked so far; one that failed is logged (its request's image still
        comes)."""
        try:
            self.pending.wait()
        except Exception:
            logger.exception("a preview failed to decode")
