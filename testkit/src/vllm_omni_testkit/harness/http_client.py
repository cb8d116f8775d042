"""One HTTP client for a test process's requests to the servers it starts.

httpx's module-level functions (``httpx.get``, ``httpx.post``) build a client, and with it an SSL context
that loads certifi's CA bundle, on every call: about 22 ms of CPU for a request that takes well under one
to answer. The harness and the tests poll servers ten to a hundred times a second while they start and
work, on the same two cores as the servers, so they ask through this shared client instead. It keeps no
connection alive between requests (each opens its own, as ``httpx.get`` does), so a server that was
stopped or restarted in between is met as a fresh request would meet it. httpx clients are thread-safe.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx

_client: httpx.Client | None = None
_lock = threading.Lock()


def new_client() -> httpx.Client:
    """A client as ``httpx.get`` makes one for each request (httpx's default timeout, no connection kept
    alive), to be shared by many."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def client() -> httpx.Client:
    """The process's shared client, made at first use."""
    global _client
    with _lock:
        if _client is None or _client.is_closed:
            _client = new_client()
        return _client


def get(url: str, **kwargs: Any) -> httpx.Response:
    """``httpx.get`` through the shared client."""
    return client().get(url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    """``httpx.post`` through the shared client."""
    return client().post(url, **kwargs)
