"""What a request's stages report while it runs, for a client that streams it (or a video job that shows its
progress): the AR stage's progress (tokens generated out of what it will generate), the diffusion stage's
denoising steps and its previews (its estimate of the clean image, decoded at steps spread over the
denoising: ``partial_images``).

A listener is registered for a request's id while it runs (``Orchestrator.generate`` does, when the
request has ``on_event``); stage clients publish to it as their replicas report, on the runtime's event
loop. Request ids are unique in a deployment, and nothing is kept for a request nobody listens to.
Events come from the replicas of this host (a stage process, an in-process stage, the AR engine); a Ray
actor's or a headless worker's replicas send their final outputs only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ARProgress:
    """The AR stage generated ``tokens`` of the ``total`` it will (GLM-Image: its prior-token grid)."""

    stage_id: int
    tokens: int
    total: int
    text: str | None = None
    """The text generated so far, where the stage writes text for the client (a text answer)."""


@dataclass(frozen=True, slots=True)
class PreviewImage:
    """The ``index``-th preview of a request's image (uint8 HxWx3), decoded mid-denoising."""

    stage_id: int
    index: int
    image: Any


@dataclass(frozen=True, slots=True)
class DenoiseProgress:
    """The diffusion stage ran ``steps`` of the request's ``total`` denoising steps (reported at most about
    every half second, from the stage's running counts)."""

    stage_id: int
    steps: int
    total: int


RequestEvent = ARProgress | PreviewImage | DenoiseProgress
EventSink = Callable[[RequestEvent], None]

_listeners: dict[str, EventSink] = {}


def listening(request_id: str) -> bool:
    """Whether anyone streams this request (stages skip work for events nobody reads)."""
    return request_id in _listeners


def publish(request_id: str, event: RequestEvent) -> None:
    """Hand ``event`` to the request's listener, if it has one (on the runtime's event loop)."""
    sink = _listeners.get(request_id)
    if sink is not None:
        sink(event)


@contextlib.contextmanager
def listen(request_id: str, sink: EventSink | None) -> Iterator[None]:
    """Route the request's events to ``sink`` while the block runs (nothing when ``sink`` is None)."""
    if sink is None:
        yield
        return
    _listeners[request_id] = sink
    try:
        yield
    finally:
        _listeners.pop(request_id, None)
