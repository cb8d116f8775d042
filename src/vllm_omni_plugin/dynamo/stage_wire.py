"""What a Dynamo router and its stage workers say to each other over Dynamo's request plane: one message
in, one reply out. Messages are msgspec structs (tensors as msgpack extensions, large payloads as
connector handles: the payloads themselves go through our connectors), carried base64-encoded under one
key of the dict Dynamo transports (a string travels faster there than bytes). Replies to stage requests
are the remote placements' shared ``wire.RemoteOutput``."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import msgspec

from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_plugin.stage.core_types import StageDiffusionCoreRequest, StageLLMCoreRequest
from vllm_omni_plugin.stage.placement.wire import RemoteOutput
from vllm_omni_plugin.stage.serialization import StageMessageCodec

KEY = "omni"
"""The one key of the dicts that travel (a request of anything else is refused)."""


class StageInfoRequest(msgspec.Struct, kw_only=True, tag="stage_info_request"):
    """Asked of a worker the router discovered, before it sends it requests."""


class StageInfo(msgspec.Struct, kw_only=True, tag="stage_info"):
    stage_id: int
    worker_id: str
    host: str
    pid: int
    config_digest: str
    """``wire.stage_config_digest``: the router refuses a worker of another deploy config."""
    replicas: int = 1


class StageStatsRequest(msgspec.Struct, kw_only=True, tag="stage_stats_request"):
    """Asked of every worker as often as replicas report progress (``/metrics`` on the router)."""


class StageStats(msgspec.Struct, kw_only=True, tag="stage_stats"):
    """A worker's running counts, all its replicas together, since it started."""

    counters: DiffusionCounters = msgspec.field(default_factory=DiffusionCounters)
    dropped: dict[str, int] = {}
    """Aborted requests its replicas dropped, by where (``StageCoreClientBase.dropped``)."""
    discarded_outputs: int = 0
    deaths: int = 0
    """Replica processes of the worker that died (and were restarted by it)."""
    calls: int = 0
    """Stage requests it was sent."""


class StageCall(msgspec.Struct, kw_only=True, tag="stage_call"):
    """Run this stage request; the reply is a ``RemoteOutput``. The router stops it through Dynamo."""

    request: StageLLMCoreRequest | StageDiffusionCoreRequest


ToStage = StageInfoRequest | StageStatsRequest | StageCall
FromStage = StageInfo | StageStats | RemoteOutput


class DynamoCodec:
    """One direction's messages, to and from the dicts Dynamo carries."""

    def __init__(self, message_type: Any) -> None:
        self._codec = StageMessageCodec(message_type)

    def pack(self, message: Any) -> dict[str, str]:
        return {KEY: base64.b64encode(self._codec.encode(message)).decode("ascii")}

    def unpack(self, data: Any) -> Any:
        """The message in ``data``; ValueError when it holds none (another sender, another version)."""
        blob = data.get(KEY) if isinstance(data, dict) else None
        if not isinstance(blob, str):
            raise ValueError(f"not a stage message of vllm-omni-plugin (expected a dict with {KEY!r})")
        try:
            return self._codec.decode(base64.b64decode(blob, validate=True))
        except (binascii.Error, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"an undecodable stage message: {exc}") from None
