"""What the remote placements (headless workers, Ray actors, Dynamo stage workers) send back to the head
for a request, how the head turns it into the stage's output or the same ``StageError`` the remote stage
raised, and what a head and a worker that joins it must agree on (:func:`stage_config_digest`).

Every remote placement replies with a ``RemoteOutput`` (msgspec, never a pickle); each has its own
transport (ZMQ for headless workers, Ray calls for actors, Dynamo's request plane), so only the reply
lives here.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from vllm_omni_plugin.config.resolved import ResolvedDeployment
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


def stage_config_digest(deployment: ResolvedDeployment, stage_id: int) -> str:
    """What head and worker must agree on: the pipeline, the stage's deploy config and its connectors."""
    stage = next(s for s in deployment.deploy.stages if s.stage_id == stage_id)
    resolved = next(s for s in deployment.stages if s.stage_id == stage_id)
    names = {*resolved.input_connectors.values(), *resolved.output_connectors.values()}
    connectors = {name: deployment.connectors[name] for name in sorted(names)}
    blob = msgspec.json.encode([deployment.pipeline, stage, connectors])
    return hashlib.sha256(blob).hexdigest()[:16]
