"""Errors of the stage runtime that reach users (as HTTP 503 / a failed result), never as tracebacks."""

from __future__ import annotations


class StageError(RuntimeError):
    """A request failed inside a stage."""

    def __init__(self, message: str, *, stage_id: int | None = None, request_id: str | None = None) -> None:
        self.stage_id = stage_id
        self.request_id = request_id
        super().__init__(message)


class StageDeadError(StageError):
    """The stage process (or engine) serving the request died; the stage is being restarted."""


class StageStartError(StageError):
    """A stage could not start (model files, memory, a crash while loading)."""


class RequestAbortedError(StageError):
    """The request was aborted (client disconnect, shutdown)."""
