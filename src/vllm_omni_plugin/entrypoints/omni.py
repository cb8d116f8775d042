"""The offline Python API: ``Omni``, the blocking twin of the stage layer's ``AsyncOmni``.

    from vllm_omni_plugin.entrypoints.omni import Omni
    with Omni("./glm-image", deploy_config="deploy/tiny_glm_image_cpu.yaml") as omni:
        results = omni.generate(["a red fox"], height=64, width=64, seed=0)

It resolves the deployment exactly as ``vllm serve --omni`` does, starts every stage replica and runs
requests through the same ``Orchestrator``, on an ``AsyncOmni`` (``stage/async_omni.py``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from vllm_omni_plugin.config import ResolvedDeployment
from vllm_omni_plugin.stage.async_omni import AsyncOmni
from vllm_omni_plugin.stage.input_processor import OmniRequest
from vllm_omni_plugin.stage.orchestrator import OmniResult


class Omni:
    """Blocking twin of :class:`AsyncOmni`: runs it on an event loop in a background thread."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="omni-loop", daemon=True)
        self._thread.start()
        try:
            self._async = self._call(AsyncOmni.create(model, **kwargs))
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def deployment(self) -> ResolvedDeployment:
        return self._async.deployment

    def submit(self, request: OmniRequest) -> Future[OmniResult]:
        return asyncio.run_coroutine_threadsafe(self._async.generate(request), self._loop)

    def generate(self, prompts: Sequence[str | OmniRequest], **params: Any) -> list[OmniResult]:
        """Run every prompt concurrently (stages overlap and batch) and return results in order."""
        requests = [p if isinstance(p, OmniRequest) else OmniRequest(prompt=p, **params) for p in prompts]
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def shutdown(self) -> None:
        if self._loop.is_running():
            try:
                self._call(self._async.shutdown())
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
