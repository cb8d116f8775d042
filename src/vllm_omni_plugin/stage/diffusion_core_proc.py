"""``StageDiffusionCoreProc``: a diffusion stage replica in its own process, and its manager.

The process loads the diffusion engine, then loops: drain the request socket (up to ``max_batch_size``
compatible requests), run them as one batch, push each result back. Images go through the stage's
output connector when one is configured (the message carries the handle). The process exits when its
parent dies, on ``StageShutdown`` and on SIGTERM.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.core_types import (
    FromStageMessage,
    StageAbort,
    StageCoreOutputs,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageFailed,
    StageProgress,
    StageReady,
    StageShutdown,
    ToStageMessage,
)
from vllm_omni_plugin.stage.payload import internalize, release
from vllm_omni_plugin.stage.serialization import StageMessageCodec

logger = get_logger(__name__)


PROGRESS_REPORT_INTERVAL_S = 0.5
"""How often a working replica tells its client how many denoising steps it has run."""

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


def _parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def run_stage_diffusion_core_proc(config: StageDiffusionProcConfig, parent_pid: int) -> None:
    """Process entry point (spawned)."""
    import zmq

    os.environ.update(config.env)
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.connect(config.input_address)
    push = context.socket(zmq.PUSH)
    push.connect(config.output_address)
    to_stage = StageMessageCodec(ToStageMessage)
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
        push.close(linger=2000)
        context.term()
        return

    last_report = [0.0]

    def report_progress(denoise_steps: int, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - last_report[0] >= PROGRESS_REPORT_INTERVAL_S:
            last_report[0] = now
            push.send(from_stage.encode(StageProgress(denoise_steps=denoise_steps)))

    if hasattr(engine, "on_progress"):
        engine.on_progress = report_progress
    max_batch = max(1, int(config.diffusion_args.get("max_batch_size", 1)))
    queued: list[StageDiffusionCoreRequest] = []
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    try:
        while not stopping and _parent_alive(parent_pid):
            if not queued:
                if not poller.poll(200):
                    continue
            while pull.poll(0):
                message = to_stage.decode(pull.recv())
                if isinstance(message, StageShutdown):
                    stopping = True
                elif isinstance(message, StageAbort):
                    dropped = set(message.request_ids)
                    for request in queued:
                        if request.request_id in dropped and input_connector is not None:
                            release(request.diffusion, input_connector)
                    queued = [r for r in queued if r.request_id not in dropped]
                elif isinstance(message, StageDiffusionCoreRequest):
                    queued.append(message)
            if stopping or not queued:
                continue
            batch, queued = queued[:max_batch], queued[max_batch:]
            outputs = _run_batch(engine, batch, config.stage_id, connector, input_connector)
            if hasattr(engine, "denoise_steps"):
                report_progress(engine.denoise_steps, force=True)
            push.send(from_stage.encode(StageCoreOutputs(outputs=outputs)))
    finally:
        for conn in (connector, input_connector):
            if conn is not None:
                conn.close()
        pull.close(linger=0)
        push.close(linger=1000)
        context.term()


def _run_batch(
    engine: Any, batch: list[StageDiffusionCoreRequest], stage_id: int, connector: Any, input_connector: Any
) -> list[StageDiffusionCoreOutput]:
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
    results = engine.generate(requests) if requests else []
    for result in results:
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
    return [outputs[m.request_id] for m in batch if m.request_id in outputs]


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
            args=(self.config, os.getpid()),
            name=f"StageDiffusionCoreProc-{self.config.stage_id}-{self.config.replica_id}",
            daemon=True,
        )
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
