"""What a head and its headless stage workers say to each other over ZMQ (msgspec, tagged), and what
they must agree on (the stage's config digest, which every remote placement shares in ``wire``; the
head's address). Replies to requests are the remote placements' shared ``wire.RemoteOutput``."""

from __future__ import annotations

import math
import time

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


class PeerSilence:
    """When a head or a worker gives the other up: after ``timeout_s`` without a message from it *and*
    as many heartbeat ticks of this side's own loop as fit in that time. A tick that comes late because
    this side's event loop was held up (a busy host, a long call holding the GIL) counts as one tick, and
    what the peer sent meanwhile is read before the next one, so a stall here never gives up a live peer;
    however slow the ticks, a silent peer is given up after the ticks are counted. (A plain wall-clock
    check that excused every late tick could excuse a dead peer for ever on a loop that stalls at every
    tick.)"""

    def __init__(self, interval_s: float, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.ticks_needed = max(2, math.ceil(timeout_s / interval_s))
        self.last_heard = time.monotonic()
        self.silent_ticks = 0

    def heard(self) -> None:
        self.last_heard = time.monotonic()
        self.silent_ticks = 0

    def tick(self) -> bool:
        """A heartbeat tick of this side; True when the peer is to be given up."""
        self.silent_ticks += 1
        return self.silent_ticks >= self.ticks_needed and time.monotonic() - self.last_heard > self.timeout_s


def parse_head_address(text: str) -> tuple[str, int]:
    """``ADDR:PORT`` (``[v6addr]:PORT`` for IPv6) -> (host, port); ValueError with the reason."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--head {text!r}: expected ADDR:PORT, e.g. 10.0.0.1:29600")
    return host, int(port)


def tcp_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
