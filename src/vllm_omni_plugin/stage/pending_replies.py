"""``PendingReplies``: requests a client sent over a socket (to a stage process or a headless worker),
awaiting their replies."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from vllm_omni_plugin.stage.core_client import StageCoreClientBase
from vllm_omni_plugin.stage.errors import RequestAbortedError


class PendingReplies:
    """``wait`` sends and waits, keeping the client's ``inflight`` set; a cancelled wait aborts the request
    through the client. ``resolve`` delivers a reply; ``fail``/``fail_all`` end waits with an error."""

    def __init__(self, client: StageCoreClientBase) -> None:
        self.client = client
        self._futures: dict[str, asyncio.Future[Any]] = {}

    def __len__(self) -> int:
        return len(self._futures)

    async def wait(self, request_id: str, send: Awaitable[Any]) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        self.client.inflight.add(request_id)
        try:
            await send
            return await future
        except asyncio.CancelledError:
            await self.client.abort([request_id])
            raise
        finally:
            self.client.inflight.discard(request_id)
            self._futures.pop(request_id, None)
            # A send that failed (the process died) may meet a death that already ended the wait: its
            # error is the send's, told by the raise; marked retrieved, so asyncio logs no "Future
            # exception was never retrieved" for it.
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()

    def resolve(self, request_id: str, reply: Any) -> bool:
        """Deliver ``reply``; False when nobody waits for it any more (aborted meanwhile)."""
        future = self._futures.pop(request_id, None)
        if future is None or future.done():
            return False
        future.set_result(reply)
        return True

    def fail(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            future = self._futures.pop(request_id, None)
            if future is not None and not future.done():
                future.set_exception(
                    RequestAbortedError("aborted", stage_id=self.client.stage_id, request_id=request_id)
                )

    def order(self) -> list[str]:
        """The waiting requests' ids in the order they were sent."""
        return list(self._futures)

    def fail_all(self, error: BaseException, *, errors: dict[str, BaseException] | None = None) -> None:
        """End every wait with ``error``, or with a request's own one in ``errors``."""
        futures, self._futures = self._futures, {}
        for request_id, future in futures.items():
            if not future.done():
                future.set_exception((errors or {}).get(request_id, error))
