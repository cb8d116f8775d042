"""What the remote placements (headless workers, Ray actors) send back to the head for a request, and
how the head turns it into the stage's output or the same ``StageError`` the remote stage raised.

Both placements reply with a ``RemoteOutput`` (msgspec, never a pickle); each has its own transport
(ZMQ for headless workers, Ray calls for actors), so only the reply lives here.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from vllm_omni_plugin.connectors.base import OmniConnector
from vllm_omni_plugin.stage.core_types import StageDiffusionCoreOutput, StageLLMCoreOutput
from vllm_omni_plugin.stage.errors import (
    RequestAbortedError,
    StageDeadError,
    StageError,
    StageRequestError,
)
from vllm_omni_plugin.stage.payload import collect_output

ErrorKind = Literal["stage", "request", "dead", "aborted"]


class RemoteOutput(msgspec.Struct, kw_only=True, tag="remote_output"):
    request_id: str
    output: StageLLMCoreOutput | StageDiffusionCoreOutput | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    """Which ``StageError`` the worker's stage raised, so the head raises (and answers) the same."""


ERROR_KINDS: dict[ErrorKind, type[StageError]] = {
    "stage": StageError,
    "request": StageRequestError,
    "dead": StageDeadError,
    "aborted": RequestAbortedError,
}
"""``RemoteOutput.error_kind`` -> the error the head raises."""


def remote_stage_output(
    message: RemoteOutput, label: str, stage_id: int, put_seconds: float, connector: OmniConnector | None
) -> StageLLMCoreOutput | StageDiffusionCoreOutput:
    """The stage output a remote replica answered with (its image collected), or the error its stage
    raised, raised here as the same ``StageError`` class."""
    if message.error is not None or message.output is None:
        kind = ERROR_KINDS[message.error_kind] if message.error_kind else StageError
        error = message.error or "the replica returned no output"
        raise kind(f"{label}: {error}", stage_id=stage_id, request_id=message.request_id)
    output = message.output
    output.timings["transfer_put"] = put_seconds
    collect_output(output, connector)
    return output


def error_kind(exc: StageError) -> ErrorKind:
    """The most specific ``RemoteOutput.error_kind`` for ``exc``."""
    return next(kind for kind, cls in reversed(ERROR_KINDS.items()) if isinstance(exc, cls))
