"""``StageDiffusionCoreProc``: a diffusion stage replica in its own process, and its manager.

The process loads the diffusion engine and hosts the replica's batch loop
(:mod:`~vllm_omni_plugin.stage.diffusion_loop`), which reports over ZMQ. A reader thread receives requests
and aborts while a batch runs; drops are reported back (``StageDropped``). Images go through the stage's
output connector when one is configured (the message carries the handle). The process exits on
SIGTERM once its running batch is done (in-flight requests drain), and at once, dropping that batch, on
``StageShutdown`` and when its parent dies.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.processes import (
    end_process,
    exit_with_parent,
    settled_environment,
    spawning_without_main,
)
from vllm_omni_plugin.stage.core_types import (
    PROGRESS_REPORT_INTERVAL_S,
    FromStageMessage,
    StageAbort,
    StageCoreOutputs,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageDropped,
    StageFailed,
    StagePreview,
    StageProgress,
    StageReady,
    StageShutdown,
    ToStageMessage,
    to_stage_message_type,
)
from vllm_omni_plugin.stage.diffusion_loop import DiffusionBatchLoop, DiffusionInbox
from vllm_omni_plugin.stage.serialization import StageMessageCodec
from vllm_omni_plugin.test_hooks import settle_before_fault

logger = get_logger(__name__)

POLL_MS = 200

ConnectorSpecTuple = tuple[str, str, dict[str, Any]]
"""(connector name, class name, extra): what a stage process needs to build a connector itself."""


@dataclass
class StageDiffusionProcConfig:
    stage_id: int
    replica_id: int
    input_address: str
    output_address: str
    diffusion_args: dict[str, Any]
    """The resolved stage's ``diffusion_args``: the worker class and ``load_model`` arguments."""
    env: dict[str, str] = field(default_factory=dict)
    output_connector: ConnectorSpecTuple | None = None
    """The connector images go back through, or None to send them inline."""
    input_connector: ConnectorSpecTuple | None = None
    """The connector the request tensors arrive through, or None (inline)."""


def load_diffusion_engine(diffusion_args: dict[str, Any]) -> tuple[Any, str]:
    """The stage's diffusion engine on the worker resolution chose (``worker_cls``, built with its
    ``WORKER_ARGS``: threads and cores): (engine, device)."""
    from vllm_omni_plugin.diffusion.worker import WORKER_ARGS

    args = dict(diffusion_args)
    model = args.pop("model")
    worker_cls = import_object(args.pop("worker_cls"))
    worker = worker_cls(**{name: args.pop(name) for name in WORKER_ARGS if name in args})
    engine = worker.load_model(model, **args)
    return engine, str(worker.device)


def _read_requests(
    context: Any, pull: Any, config: StageDiffusionProcConfig, loop: DiffusionBatchLoop
) -> None:
    """The reader thread: requests into the inbox, aborts applied at once (acknowledged on a socket of its
    own, as ZMQ sockets are used by one thread each; ``pull`` is handed over from the main thread)."""
    import zmq

    acks = context.socket(zmq.PUSH)
    acks.connect(config.output_address)
    to_stage = StageMessageCodec(to_stage_message_type())
    untyped = StageMessageCodec(ToStageMessage)
    from_stage = StageMessageCodec(FromStageMessage)
    inbox = loop.inbox
    try:
        while not inbox.closed:
            if not pull.poll(POLL_MS):
                continue
            frame = pull.recv()
            try:
                message = to_stage.decode(frame)
            except msgspec.DecodeError as exc:
                refusal = _refusal(untyped, frame, exc, config.stage_id)
                if refusal is None:
                    logger.error("stage %d: an undecodable message; dropped", config.stage_id)
                else:
                    acks.send(from_stage.encode(StageCoreOutputs(outputs=[refusal], pid=os.getpid())))
                continue
            if isinstance(message, StageShutdown):
                inbox.interrupt()
            elif isinstance(message, StageAbort):
                ids = loop.abort(message.request_ids)
                if ids:
                    acks.send(
                        from_stage.encode(StageDropped(request_ids=ids, where="queue", pid=os.getpid()))
                    )
            elif isinstance(message, StageDiffusionCoreRequest):
                inbox.add(message)
    finally:
        pull.close(linger=0)
        acks.close(linger=1000)


def _refusal(
    untyped: StageMessageCodec, frame: bytes, exc: Exception, stage_id: int
) -> StageDiffusionCoreOutput | None:
    """The answer to a request whose diffusion part is of no registered kind (None: not a request)."""
    try:
        message = untyped.decode(frame)
    except msgspec.DecodeError:
        return None
    if not isinstance(message, StageDiffusionCoreRequest):
        return None
    return StageDiffusionCoreOutput(
        request_id=message.request_id, stage_id=stage_id, error=f"bad diffusion request: {exc}", invalid=True
    )


class _ZmqReport:
    """The loop's reports as stage messages on the process's output socket (the loop's thread only)."""

    def __init__(self, push: Any) -> None:
        self.push = push
        self.codec = StageMessageCodec(FromStageMessage)
        self.last_progress = 0.0

    def outputs(self, outputs: list[StageDiffusionCoreOutput]) -> None:
        self.push.send(self.codec.encode(StageCoreOutputs(outputs=outputs, pid=os.getpid())))

    def dropped(self, request_ids: list[str], where: str) -> None:
        self.push.send(self.codec.encode(StageDropped(request_ids=request_ids, where=where, pid=os.getpid())))

    def preview(self, request_id: str, index: int, image: Any) -> None:
        message = StagePreview(request_id=request_id, index=index, image=image, pid=os.getpid())
        self.push.send(self.codec.encode(message))

    def progress(
        self, counters: DiffusionCounters, *, force: bool, steps: dict[str, tuple[int, int]] | None = None
    ) -> None:
        now = time.monotonic()
        if force or now - self.last_progress >= PROGRESS_REPORT_INTERVAL_S:
            self.last_progress = now
            message = StageProgress(counters=counters, pid=os.getpid(), steps=steps or {})
            self.push.send(self.codec.encode(message))


def run_stage_diffusion_core_proc(config: StageDiffusionProcConfig) -> None:
    """Process entry point (spawned)."""
    import zmq

    os.environ.update(config.env)
    inbox = DiffusionInbox()

    def on_signal(signum: int, frame: Any) -> None:
        inbox.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    exit_with_parent(f"StageDiffusionCoreProc {config.stage_id}-{config.replica_id}", inbox.interrupt)

    context = zmq.Context()
    pull = context.socket(zmq.PULL)  # connected before StageReady: the client sends only to a connected peer
    pull.connect(config.input_address)
    outbox = zmq.Context()  # the loop's thread alone uses it: it can be ended from there (the fault hook)
    push = outbox.socket(zmq.PUSH)
    push.connect(config.output_address)

    def deliver_sent() -> None:
        push.close(linger=30_000)
        outbox.term()  # returns once what was sent has left

    settle_before_fault(deliver_sent)
    from_stage = StageMessageCodec(FromStageMessage)

    connector = None
    input_connector = None
    try:
        start = time.perf_counter()
        engine, device = load_diffusion_engine(config.diffusion_args)
        from vllm_omni_plugin.connectors.base import make_connector

        if config.output_connector is not None:
            connector = make_connector(*config.output_connector)
        if config.input_connector is not None:
            input_connector = make_connector(*config.input_connector)
        push.send(
            from_stage.encode(
                StageReady(
                    pid=os.getpid(),
                    load_seconds=time.perf_counter() - start,
                    device=device,
                    weight_bytes=engine.weight_bytes,
                )
            )
        )
    except Exception as exc:  # reported to the parent as one line; the details go to the log
        logger.error("%s", traceback.format_exc())
        push.send(from_stage.encode(StageFailed(error=f"{type(exc).__name__}: {exc}")))
        pull.close(linger=0)
        push.close(linger=2000)
        outbox.term()
        context.term()
        end_process(0)

    loop = DiffusionBatchLoop(
        engine,
        config.stage_id,
        _ZmqReport(push),
        max_batch=int(config.diffusion_args.get("max_batch_size", 1)),
        inbox=inbox,
        input_connector=input_connector,
        output_connector=connector,
    )
    reader = threading.Thread(
        target=_read_requests, args=(context, pull, config, loop), name="stage-reader", daemon=True
    )
    reader.start()
    try:
        loop.serve()
    finally:
        inbox.stopping = inbox.closed = True
        reader.join(5)
        for conn in (connector, input_connector):
            if conn is not None:
                conn.close()
        push.close(linger=1000)
        outbox.term()
        context.term()
    end_process(0)  # all it held is released: the interpreter's module teardown would only cost CPU


class StageDiffusionCoreProcManager:
    """Starts, watches and restarts one ``StageDiffusionCoreProc``."""

    def __init__(self, config: StageDiffusionProcConfig) -> None:
        self.config = config
        self.process: multiprocessing.process.BaseProcess | None = None

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=run_stage_diffusion_core_proc,
            args=(self.config,),
            name=f"StageDiffusionCoreProc-{self.config.stage_id}-{self.config.replica_id}",
            daemon=True,
        )
        with settled_environment(), spawning_without_main():
            self.process.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode if self.process is not None else None

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None:
            return
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.process = None
