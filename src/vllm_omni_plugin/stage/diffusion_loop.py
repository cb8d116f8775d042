"""The one batch loop of a diffusion replica, hosted by its stage process, the in-process client's thread
and the Ray actor alike: each host keeps only its transport (ZMQ, asyncio futures, actor calls).

Requests wait in a :class:`DiffusionInbox`; the loop takes what is queued (up to ``max_batch_size``),
reads its payloads through the input connector, runs it as one engine call (which batches compatible
requests), puts the images through the output connector and hands the outputs to its host's
:class:`BatchReport`. An aborted request still queued is dropped with its payload (``where="queue"``); one
in the running batch gets no image, and an image already put for it is freed (``where="batch"``; a batch
whose every request is aborted stops at the end of the current step).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from vllm_omni_plugin.connectors.base import ConnectorHandle
from vllm_omni_plugin.hold_points import hold_point
from vllm_omni_plugin.stage.core_types import StageDiffusionCoreOutput, StageDiffusionCoreRequest
from vllm_omni_plugin.stage.payload import internalize, release

if TYPE_CHECKING:
    from vllm_omni_plugin.connectors.base import OmniConnector
    from vllm_omni_plugin.diffusion.engine import DiffusionEngine

POLL_S = 0.2
"""How long an idle loop waits for a request before it looks at its stop flags again."""


class DiffusionInbox:
    """Requests waiting for the loop, the running batch's ids, aborts and the stop orders; filled by the
    host's receiving side (another thread), emptied by the loop."""

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
        self.draining = False
        """Stop once nothing is queued (what is queued still runs)."""
        self.interrupted = False
        """Not even the running batch finishes (``StageShutdown``, a dead parent): nobody will read it."""
        self.closed = False
        """The batch loop has ended: a receiving thread ends too."""

    def is_aborted(self, request_id: str) -> bool:
        return self.interrupted or request_id in self.aborted

    def interrupt(self) -> None:
        self.interrupted = self.stopping = True

    def drain(self) -> None:
        with self.lock:
            self.draining = True
            self.lock.notify()

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
            if not self.queued and not self.stopping and not self.draining:
                self.lock.wait(POLL_S)
            if self.draining and not self.queued:
                self.stopping = True
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


class BatchReport(Protocol):
    """What a host does with what the loop reports (called on the loop's thread)."""

    def outputs(self, outputs: list[StageDiffusionCoreOutput]) -> None:
        """The batch's outputs (an aborted request's never among them)."""

    def dropped(self, request_ids: list[str], where: str) -> None:
        """Requests aborted while their batch ran: nothing more comes for them (``where="batch"``)."""

    def progress(self, denoise_steps: int, *, force: bool) -> None:
        """The engine's running count of denoising steps: after each step, and ``force`` after a batch."""


class DiffusionBatchLoop:
    """Runs the inbox's batches on one engine and reports to its host."""

    def __init__(
        self,
        engine: DiffusionEngine,
        stage_id: int,
        report: BatchReport,
        *,
        max_batch: int,
        inbox: DiffusionInbox | None = None,
        input_connector: OmniConnector | None = None,
        output_connector: OmniConnector | None = None,
    ) -> None:
        self.engine = engine
        self.stage_id = stage_id
        self.report = report
        self.max_batch = max(1, max_batch)
        self.inbox = inbox or DiffusionInbox()
        self.input_connector = input_connector
        self.output_connector = output_connector
        engine.on_progress = self._step_done

    def _step_done(self, denoise_steps: int) -> None:
        self.report.progress(denoise_steps, force=False)
        # tests hold the batch here (off unless a test arms the point)
        inbox = self.inbox
        hold_point("dit.step", " ".join(sorted(inbox.running)), give_up=lambda: inbox.stopping)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Abort requests: those still queued are dropped with their payloads (their ids returned, for
        the host to report as dropped from the queue); running ones get no image."""
        dropped = self.inbox.abort(request_ids)
        if self.input_connector is not None:
            for request in dropped:
                release(request.diffusion, self.input_connector)
        return [r.request_id for r in dropped]

    def serve(self) -> None:
        """Run batches until the inbox stops."""
        try:
            while not self.inbox.stopping:
                batch = self.inbox.take(self.max_batch)
                if batch:
                    self.run_batch(batch)
        finally:
            self.inbox.closed = True

    def run_batch(self, batch: list[StageDiffusionCoreRequest]) -> None:
        inbox = self.inbox
        outputs, aborted = self._run(batch)
        aborted |= inbox.finish()
        self.report.progress(self.engine.denoise_steps, force=True)
        connector = self.output_connector
        for output in outputs:
            if output.request_id in aborted and output.image_handle is not None and connector is not None:
                # aborted after its image was put: nobody will read it
                connector.cleanup(msgspec.convert(output.image_handle, ConnectorHandle))
        outputs = [o for o in outputs if o.request_id not in aborted]
        if outputs:
            self.report.outputs(outputs)
        if aborted and not inbox.interrupted:
            self.report.dropped(sorted(aborted), "batch")

    def _run(self, batch: list[StageDiffusionCoreRequest]) -> tuple[list[StageDiffusionCoreOutput], set[str]]:
        """Outputs of the batch's requests (images put through the output connector), and the ids of
        those aborted before their image was made."""
        engine, stage_id, is_aborted = self.engine, self.stage_id, self.inbox.is_aborted
        requests = []
        transfer: dict[str, float] = {}
        outputs: dict[str, StageDiffusionCoreOutput] = {}
        for message in batch:
            try:
                fields = message.diffusion
                if self.input_connector is not None:
                    t0 = time.perf_counter()
                    fields = internalize(fields, self.input_connector)
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
                if self.output_connector is not None:
                    handle = self.output_connector.put(image_tensor(result.image))
                    out.image_handle = msgspec.to_builtins(handle)
                else:
                    out.image = result.image
            outputs[result.request_id] = out
        return [outputs[m.request_id] for m in batch if m.request_id in outputs], aborted


def image_tensor(image: Any) -> Any:
    """An image array as the uint8 tensor a connector takes."""
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(np.asarray(image, dtype=np.uint8)))
