"""``StageDiffusionCoreProc``: a diffusion stage replica in its own process, and its manager.

The process loads the diffusion engine, then loops: take what is queued (up to ``max_batch_size``
requests), run it as one engine call (which batches compatible requests), push each result back. A
reader thread receives requests and aborts while a batch runs: an aborted request still queued is
dropped with its payload; one in the running batch gets no image (a batch whose every request is aborted
stops at the end of the current step). Both are reported back (``StageDropped``). Images go through the
stage's output connector when one is configured (the message carries the handle). The process exits on
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

from vllm_omni_plugin.connectors.base import ConnectorHandle
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.processes import exit_with_parent, spawning_without_main
from vllm_omni_plugin.stage.core_types import (
    PROGRESS_REPORT_INTERVAL_S,
    FromStageMessage,
    StageAbort,
    StageCoreOutputs,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageDropped,
    StageFailed,
    StageProgress,
    StageReady,
    StageShutdown,
    ToStageMessage,
)
from vllm_omni_plugin.stage.payload import internalize, release
from vllm_omni_plugin.stage.serialization import StageMessageCodec

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
    """The resolved stage's ``diffusion_args``: the worker class, ``load_model`` arguments and defaults."""
    env: dict[str, str] = field(default_factory=dict)
    output_connector: ConnectorSpecTuple | None = None
    """The connector images go back through, or None to send them inline."""
    input_connector: ConnectorSpecTuple | None = None
    """The connector the request tensors arrive through, or None (inline)."""


def load_diffusion_engine(diffusion_args: dict[str, Any]) -> tuple[Any, str]:
    """The stage's diffusion engine on the worker resolution chose (``worker_cls``): (engine, device)."""
    args = dict(diffusion_args)
    model = args.pop("model")
    worker_cls = import_object(args.pop("worker_cls"))
    worker = worker_cls()
    engine = worker.load_model(model, **args)
    return engine, str(worker.device)


class _Inbox:
    """What the reader thread received, for the batch loop: queued requests, aborts, the stop order."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.queued: list[StageDiffusionCoreRequest] = []
        self.running: set[str] = set()
        """Ids of the batch being run."""
        self.aborted: set[str] = set()
        """Ids of the running batch aborted while it runs."""
        self.stopping = False
        """No further batch (SIGTERM: the running one finishes). Set without the lock, as a signal
        handler sets it: readers look again at least every poll."""
        self.interrupted = False
        """Not even the running batch finishes (``StageShutdown``, a dead parent): nobody will read it."""
        self.closed = False
        """The batch loop has ended: the reader thread ends too."""

    def is_aborted(self, request_id: str) -> bool:
        return self.interrupted or request_id in self.aborted

    def interrupt(self) -> None:
        self.interrupted = self.stopping = True

    def add(self, request: StageDiffusionCoreRequest) -> None:
        with self.lock:
            self.queued.append(request)
            self.lock.notify()

    def abort(self, request_ids: list[str]) -> list[StageDiffusionCoreRequest]:
        """Drop the queued requests among ``request_ids`` (returned) and mark running ones aborted."""
        ids = set(request_ids)
        with self.lock:
            dropped = [r for r in self.queued if r.request_id in ids]
            self.queued = [r for r in self.queued if r.request_id not in ids]
            self.aborted |= ids & self.running
        return dropped

    def take(self, max_batch: int) -> list[StageDiffusionCoreRequest]:
        """The next batch (empty after a poll interval with nothing queued, or when stopping)."""
        with self.lock:
            if not self.queued and not self.stopping:
                self.lock.wait(POLL_MS / 1000)
            if self.stopping:
                return []
            batch, self.queued = self.queued[:max_batch], self.queued[max_batch:]
            self.running = {r.request_id for r in batch}
            return batch

    def finish(self) -> set[str]:
        """The running batch is done: the ids aborted while it ran."""
        with self.lock:
            aborted, self.aborted, self.running = self.aborted, set(), set()
        return aborted


def _read_requests(
    context: Any, pull: Any, config: StageDiffusionProcConfig, inbox: _Inbox, input_connector: Any
) -> None:
    """The reader thread: requests into the inbox, aborts applied at once (acknowledged on a socket of its
    own, as ZMQ sockets are used by one thread each; ``pull`` is handed over from the main thread)."""
    import zmq

    acks = context.socket(zmq.PUSH)
    acks.connect(config.output_address)
    to_stage = StageMessageCodec(ToStageMessage)
    from_stage = StageMessageCodec(FromStageMessage)
    try:
        while not inbox.closed:
            if not pull.poll(POLL_MS):
                continue
            try:
                message = to_stage.decode(pull.recv())
            except msgspec.DecodeError:
                logger.error("stage %d: an undecodable message; dropped", config.stage_id)
                continue
            if isinstance(message, StageShutdown):
                inbox.interrupt()
            elif isinstance(message, StageAbort):
                dropped = inbox.abort(message.request_ids)
                for request in dropped:
                    if input_connector is not None:
                        release(request.diffusion, input_connector)
                if dropped:
                    ids = [r.request_id for r in dropped]
                    acks.send(
                        from_stage.encode(StageDropped(request_ids=ids, where="queue", pid=os.getpid()))
                    )
            elif isinstance(message, StageDiffusionCoreRequest):
                inbox.add(message)
    finally:
        pull.close(linger=0)
        acks.close(linger=1000)


def run_stage_diffusion_core_proc(config: StageDiffusionProcConfig) -> None:
    """Process entry point (spawned)."""
    import zmq

    os.environ.update(config.env)
    inbox = _Inbox()

    def on_signal(signum: int, frame: Any) -> None:
        inbox.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    exit_with_parent(f"StageDiffusionCoreProc {config.stage_id}-{config.replica_id}", inbox.interrupt)

    context = zmq.Context()
    pull = context.socket(zmq.PULL)  # connected before StageReady: the client sends only to a connected peer
    pull.connect(config.input_address)
    push = context.socket(zmq.PUSH)
    push.connect(config.output_address)
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
                StageReady(pid=os.getpid(), load_seconds=time.perf_counter() - start, device=device)
            )
        )
    except Exception as exc:  # reported to the parent as one line; the details go to the log
        logger.error("%s", traceback.format_exc())
        push.send(from_stage.encode(StageFailed(error=f"{type(exc).__name__}: {exc}")))
        pull.close(linger=0)
        push.close(linger=2000)
        context.term()
        return

    last_report = [0.0]

    def report_progress(denoise_steps: int, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - last_report[0] >= PROGRESS_REPORT_INTERVAL_S:
            last_report[0] = now
            push.send(from_stage.encode(StageProgress(denoise_steps=denoise_steps, pid=os.getpid())))

    if hasattr(engine, "on_progress"):
        engine.on_progress = report_progress
    max_batch = max(1, int(config.diffusion_args.get("max_batch_size", 1)))
    reader = threading.Thread(
        target=_read_requests,
        args=(context, pull, config, inbox, input_connector),
        name="stage-reader",
        daemon=True,
    )
    reader.start()
    try:
        while not inbox.stopping:
            batch = inbox.take(max_batch)
            if not batch:
                continue
            outputs, aborted = _run_batch(
                engine, batch, config.stage_id, connector, input_connector, inbox.is_aborted
            )
            aborted |= inbox.finish()
            if hasattr(engine, "denoise_steps"):
                report_progress(engine.denoise_steps, force=True)
            for output in outputs:
                if output.request_id in aborted and output.image_handle is not None and connector is not None:
                    # aborted after its image was put: nobody will read it
                    connector.cleanup(msgspec.convert(output.image_handle, ConnectorHandle))
            outputs = [o for o in outputs if o.request_id not in aborted]
            if outputs:
                push.send(from_stage.encode(StageCoreOutputs(outputs=outputs, pid=os.getpid())))
            if aborted and not inbox.interrupted:
                dropped = StageDropped(request_ids=sorted(aborted), where="batch", pid=os.getpid())
                push.send(from_stage.encode(dropped))
    finally:
        inbox.stopping = inbox.closed = True
        reader.join(5)
        for conn in (connector, input_connector):
            if conn is not None:
                conn.close()
        push.close(linger=1000)
        context.term()


def _run_batch(
    engine: Any,
    batch: list[StageDiffusionCoreRequest],
    stage_id: int,
    connector: Any,
    input_connector: Any,
    is_aborted: Any,
) -> tuple[list[StageDiffusionCoreOutput], set[str]]:
    """Outputs of the batch's requests (images put through ``connector``), and the ids of those aborted
    before their image was made."""

    requests = []
    transfer: dict[str, float] = {}
    outputs: dict[str, StageDiffusionCoreOutput] = {}
    for message in batch:
        try:
            fields = message.diffusion
            if input_connector is not None:
                t0 = time.perf_counter()
                fields = internalize(fields, input_connector)
                transfer[message.request_id] = time.perf_counter() - t0
            requests.append(msgspec.convert(fields, engine.request_type))
        except Exception as exc:  # a bad or lost payload fails this request only
            outputs[message.request_id] = StageDiffusionCoreOutput(
                request_id=message.request_id,
                stage_id=stage_id,
                error=f"bad diffusion request: {exc}",
                invalid=isinstance(exc, msgspec.ValidationError),
            )
    results = engine.generate(requests, is_aborted) if requests else []
    aborted: set[str] = set()
    for result in results:
        if result.aborted or is_aborted(result.request_id):
            aborted.add(result.request_id)
            continue
        out = StageDiffusionCoreOutput(
            request_id=result.request_id,
            stage_id=stage_id,
            error=result.error,
            invalid=result.invalid,
            timings={**(result.timings or {}), "transfer_in": transfer.get(result.request_id, 0.0)},
            latents=result.latents,
        )
        if result.error is None:
            image = result.image
            if connector is not None:
                out.image_handle = msgspec.to_builtins(connector.put(image_tensor(image)))
            else:
                out.image = image
        outputs[result.request_id] = out
    return [outputs[m.request_id] for m in batch if m.request_id in outputs], aborted


def image_tensor(image: Any) -> Any:
    """An image array as the uint8 tensor a connector takes."""
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(np.asarray(image, dtype=np.uint8)))


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
        with spawning_without_main():
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
