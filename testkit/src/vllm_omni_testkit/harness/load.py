"""Load for the offline benchmarks: requests kept in flight the way clients of a busy server keep them."""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Iterable
from typing import Any


def in_flight(omni: Any, requests: Iterable[Any], concurrency: int) -> list[Any]:
    """Every request's result (in completion order), with ``concurrency`` of them in flight at any time:
    a new one is submitted as one finishes. ``omni`` is an ``Omni`` (anything with ``submit``)."""
    pending = iter(requests)
    running = {omni.submit(r) for r in itertools.islice(pending, concurrency)}
    results = []
    while running:
        done, running = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
            results.append(future.result())
            running.update(omni.submit(r) for r in itertools.islice(pending, 1))
    return results
