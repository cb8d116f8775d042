"""Errors of the stage runtime that reach users (as an HTTP status / a failed result), never as tracebacks.

Each class carries the HTTP status a server answers with, so a server maps a failure by its type.
"""

from __future__ import annotations

from typing import ClassVar, Literal

DeathPlace = Literal["running", "queued", "unsent"]


class StageError(RuntimeError):
    """A request failed inside a stage."""

    http_status: ClassVar[int] = 500

    def __init__(self, message: str, *, stage_id: int | None = None, request_id: str | None = None) -> None:
        self.stage_id = stage_id
        self.request_id = request_id
        super().__init__(message)


class StageRequestError(StageError):
    """A stage refused what the request asks for (a size or sampling parameter it cannot take)."""

    http_status = 400


class StageDeadError(StageError):
    """The stage process (or engine) serving the request died; the stage is being restarted. The
    orchestrator runs the request's stage again while the request's retry budget lasts."""

    http_status = 503
    retryable: ClassVar[bool] = True
    """Whether the orchestrator runs the request again (the deployment brings the replica back itself)."""

    def __init__(
        self,
        message: str,
        *,
        stage_id: int | None = None,
        request_id: str | None = None,
        where: DeathPlace = "running",
    ) -> None:
        super().__init__(message, stage_id=stage_id, request_id=request_id)
        self.where: DeathPlace = where
        """Where the request was: ``running`` (or may have been: the default), ``queued`` (its client
        knows it still waited in the dead replica's queue, so it cannot have caused the death) or
        ``unsent`` (no live replica took it)."""

    @property
    def ran(self) -> bool:
        """The request may have caused the death."""
        return self.where == "running"


class WorkerLostError(StageDeadError):
    """A headless stage worker (on another host) went away. Its requests fail at once (503) rather than
    wait: the stage comes back only when someone starts a worker that rejoins."""

    retryable = False


class RetriesExhaustedError(StageDeadError):
    """Replica deaths interrupted the request more often than its retry budget (``max_retries``) allows:
    a request that kills its stage every time cannot keep killing it."""


class QuarantinedError(StageError):
    """The request's replica died while running it alone, after its first batch had died under it too:
    it is not run again, so that it cannot take other requests down. Not 503 (whose clients retry) but
    500: the server failed on this request, which the log names, and running it again would fail again."""

    http_status = 500


class StageStartError(StageError):
    """A stage could not start (model files, memory, a crash while loading)."""

    http_status = 503


class StagePlacementError(StageStartError):
    """A replica cannot be placed: it asks for what no node of the cluster has (or there is no cluster
    to join). The deploy config and the cluster disagree, which the user fixes (the CLI exits 2)."""


class RequestAbortedError(StageError):
    """The request was aborted (client disconnect, shutdown)."""

    http_status = 503
