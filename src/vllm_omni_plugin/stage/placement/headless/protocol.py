"""What a head and its headless stage workers say to each other over ZMQ (msgspec, tagged), and what
they must agree on (the stage's config digest, which every remote placement shares in ``wire``; the
head's address). Replies to requests are the remote placements' shared ``wire.RemoteOutput``."""

from __future__ import annotations

import msgspec

from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_plugin.stage.core_types import StageAbort, StageDiffusionCoreRequest, StageLLMCoreRequest
from vllm_omni_plugin.stage.placement.wire import RemoteOutput
from vllm_omni_plugin.stage.placement.wire import stage_config_digest as stage_config_digest


class WorkerRegister(msgspec.Struct, kw_only=True, tag="register"):
    stage_id: int
    worker_id: str
    host: str
    pid: int
    config_digest: str


class WorkerAccepted(msgspec.Struct, kw_only=True, tag="accepted"):
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


class WorkerRejected(msgspec.Struct, kw_only=True, tag="rejected"):
    reason: str


class Heartbeat(msgspec.Struct, kw_only=True, tag="heartbeat"):
    pass


class WorkerLeaving(msgspec.Struct, kw_only=True, tag="leaving"):
    reason: str


class WorkerProgress(msgspec.Struct, kw_only=True, tag="worker_progress"):
    """The worker's running diffusion counts (all its replicas summed), sent while they change."""

    counters: DiffusionCounters


class HeadShutdown(msgspec.Struct, kw_only=True, tag="head_shutdown"):
    pass


class RemoteRequest(msgspec.Struct, kw_only=True, tag="remote_request"):
    request: StageLLMCoreRequest | StageDiffusionCoreRequest


HeadMessage = WorkerAccepted | WorkerRejected | Heartbeat | HeadShutdown | RemoteRequest | StageAbort
WorkerMessage = WorkerRegister | Heartbeat | WorkerLeaving | RemoteOutput | WorkerProgress


def parse_head_address(text: str) -> tuple[str, int]:
    """``ADDR:PORT`` (``[v6addr]:PORT`` for IPv6) -> (host, port); ValueError with the reason."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--head {text!r}: expected ADDR:PORT, e.g. 10.0.0.1:29600")
    return host, int(port)


def tcp_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
