"""The one batch loop of a diffusion replica, hosted by its stage process, the in-process client's thread
and the Ray actor alike: each host keeps only its transport (ZMQ, asyncio futures, actor calls).

Requests wait in a :class:`DiffusionInbox`; the loop takes what is queued (up to ``max_batch_size``),
reads its payloads through the input connector, runs it as one engine call (which batches compatible
requests), puts the images through the output connector and hands the outputs to its host's
:class:`BatchReport`. An aborted request still queued is dropped with its payload (``where="queue"``); one
in the running batch gets no image, and an image already put for it is freed (``where="batch"``; a batch
whose every request is aborted stops at the end of the current step).

With ``batching: step`` the loop does not wait for a batch to finish: what is queued starts as soon as
fewer than ``max_batch_size`` requests run, as groups (one pipeline call each, on a thread of its own)
whose denoiser calls share forwards step by step (:mod:`vllm_omni_plugin.diffusion.step_batching`); each
group's outputs are reported as soon as it is done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from vllm_omni_plugin.connectors.base import ConnectorHandle
from vllm_omni_plugin.diffusion.params import DiffusionCounters, DiffusionResult
from vllm_omni_plugin.stage.core_types import StageDiffusionCoreOutput, StageDiffusionCoreRequest
from vllm_omni_plugin.stage.payload import internalize, release
from vllm_omni_plugin.test_hooks import fault_point, hold_armed, hold_point

if TYPE_CHECKING:
    from vllm_omni_plugin.connectors.base import OmniConnector
    from vllm_omni_plugin.diffusion.engine import DiffusionEngine

POLL_S = 0.2
"""How long an idle loop waits for a request before it looks at its stop flags again."""


def queued_priority(request: StageDiffusionCoreRequest) -> int:
    """A queued request's priority (lower first; vLLM's convention)."""
    return getattr(request.diffusion, "priority", 0)


def batch_prefix(alone: Sequence[bool], limit: int) -> int:
    """How many of the queued requests (in order; ``alone``: each one's flag) start together: one that
    runs alone starts by itself, the others up to ``limit`` and not past one that runs alone. The stage
    takes its batches by this rule, and its client reads from it which requests a dead process was
    running."""
    if not alone or limit < 1:
        return 0
    if alone[0]:
        return 1
    count = 0
    while count < min(limit, len(alone)) and not alone[count]:
        count += 1
    return count


Estimate = Callable[[list[Any]], int]
"""What a group needs of one budget."""


class GroupBudget:
    """Which admitted groups start now (``batching: step``): groups in flight share each step's forwards,
    so what they need adds up, and together they keep to each of the stage's budgets: ``limits`` pairs a
    limit (None: unbounded) with how much of it a group needs (the engine's activation bytes within its
    memory budget, its latent tokens within ``max_step_tokens``). Groups start in the order they were
    admitted; the first waiting one starts on a stage with nothing in flight whatever it needs (the
    engine admits only groups that fit alone, or that run alone)."""

    def __init__(self, *limits: tuple[int | None, Estimate]) -> None:
        self.limits = [(limit, estimate) for limit, estimate in limits if limit is not None]
        self.waiting: list[list[Any]] = []
        self.in_flight: dict[str, list[int]] = {}
        """Key of each group in flight -> what it needs of each budget."""

    @property
    def waiting_rows(self) -> int:
        return sum(len(group) for group in self.waiting)

    def admit(self, groups: list[list[Any]]) -> None:
        self.waiting += groups

    def start(self, key_of: Callable[[list[Any]], str]) -> list[list[Any]]:
        """The waiting groups that start now (counted in flight until :meth:`done`)."""
        started = []
        while self.waiting:
            needs = [estimate(self.waiting[0]) for _, estimate in self.limits]
            used = [sum(column) for column in zip(*self.in_flight.values(), strict=True)] or [0] * len(needs)
            if self.in_flight and any(
                u + n > lim for (lim, _), u, n in zip(self.limits, used, needs, strict=True)
            ):
                break
            group = self.waiting.pop(0)
            self.in_flight[key_of(group)] = needs
            started.append(group)
        return started

    def done(self, key: str) -> None:
        self.in_flight.pop(key, None)


def group_key(group: list[Any]) -> str:
    """A group's name in the loop (its requests' ids)."""
    return " ".join(r.request_id for r in group)


class DiffusionInbox:
    """Requests waiting for the loop, the running batch's ids, aborts and the stop orders; filled by the
    host's receiving side (another thread), emptied by the loop."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.queued: list[StageDiffusionCoreRequest] = []
        self.running: set[str] = set()
        """Ids of the batch being run."""
        self.alone_running = False
        """The running request runs alone (``StageDiffusionCoreRequest.alone``): nothing starts beside it."""
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
        self.arrived: dict[str, float] = {}
        """When each queued request arrived (``time.monotonic``)."""
        self.waited: list[float] = []
        """Queue waits of the requests started since :meth:`started_waits` was last called."""
        self.finished: list[tuple[str, list[Any]]] = []
        """Groups done (``batching: step``): their keys and engine results, for the loop's thread."""
        self.previews: list[tuple[str, int, Any]] = []
        """Previews made on a group's thread (``batching: step``), for the loop's thread to report."""

    def is_aborted(self, request_id: str) -> bool:
        return self.interrupted or request_id in self.aborted

    def interrupt(self) -> None:
        self.interrupted = self.stopping = True

    def drain(self) -> None:
        with self.lock:
            self.draining = True
            self.lock.notify()

    def add(self, request: StageDiffusionCoreRequest) -> None:
        """Queued behind those of its priority or better (all of priority 0 but with
        ``scheduling_policy: priority``: in arrival order)."""
        with self.lock:
            at, priority = len(self.queued), queued_priority(request)
            while at > 0 and queued_priority(self.queued[at - 1]) > priority:
                at -= 1
            self.queued.insert(at, request)
            self.arrived[request.request_id] = time.monotonic()
            self.lock.notify()

    def abort(self, request_ids: list[str]) -> list[StageDiffusionCoreRequest]:
        """Drop the queued requests among ``request_ids`` (returned) and mark running ones aborted."""
        ids = set(request_ids)
        with self.lock:
            dropped = [r for r in self.queued if r.request_id in ids]
            self.queued = [r for r in self.queued if r.request_id not in ids]
            for request in dropped:
                self.arrived.pop(request.request_id, None)
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
            count = batch_prefix([r.alone for r in self.queued], max_batch)
            batch, self.queued = self.queued[:count], self.queued[count:]
            self.running = {r.request_id for r in batch}
            self.alone_running = bool(batch) and batch[0].alone
            self._started(batch)
            return batch

    def take_rows(self, free: int, wait_s: float = 0.0) -> list[StageDiffusionCoreRequest]:
        """Up to ``free`` queued requests to start (``batching: step``). While others run, fewer than
        ``free`` wait until the first of them has waited ``wait_s``, so that requests arriving close
        together start as one group; an idle stage starts what it has at once. Returns nothing (after at
        most a poll interval) while there is nothing to start yet."""
        with self.lock:
            if self.draining and not self.queued:
                self.stopping = True
            if self.finished or self.previews:
                return []
            if self.stopping:  # the groups in flight finish: wait for their news, not in a busy loop
                self.lock.wait(POLL_S)
                return []
            timeout = POLL_S
            # One that runs alone starts once nothing runs, and nothing starts beside it.
            blocked = self.alone_running or (
                bool(self.queued) and self.queued[0].alone and bool(self.running)
            )
            if self.queued and free > 0 and not blocked:
                waited = time.monotonic() - self.arrived.get(self.queued[0].request_id, 0.0)
                count = batch_prefix([r.alone for r in self.queued], free)
                cut = count < len(self.queued)  # by one that runs alone: nothing more can join
                if not self.running or len(self.queued) >= free or waited >= wait_s or cut:
                    rows, self.queued = self.queued[:count], self.queued[count:]
                    self.running |= {r.request_id for r in rows}
                    self.alone_running = rows[0].alone
                    self._started(rows)
                    return rows
                timeout = wait_s - waited
            self.lock.wait(timeout)
            return []

    def _started(self, requests: list[StageDiffusionCoreRequest]) -> None:
        now = time.monotonic()
        self.waited += [now - self.arrived.pop(r.request_id, now) for r in requests]

    def started_waits(self) -> list[float]:
        """How long each request started since the last call had waited in the queue (seconds)."""
        with self.lock:
            waited, self.waited = self.waited, []
        return waited

    def group_done(self, key: str, results: list[Any]) -> None:
        """A group's thread hands its results to the loop (``batching: step``)."""
        with self.lock:
            self.finished.append((key, results))
            self.lock.notify()

    def preview(self, request_id: str, index: int, image: Any) -> None:
        with self.lock:
            self.previews.append((request_id, index, image))
            self.lock.notify()

    def pop_previews(self) -> list[tuple[str, int, Any]]:
        with self.lock:
            previews, self.previews = self.previews, []
        return previews

    def pop_finished(self) -> list[tuple[str, list[Any]]]:
        """Groups done since the last call: their keys and results."""
        with self.lock:
            finished, self.finished = self.finished, []
        return finished

    def done(self, request_ids: list[str]) -> set[str]:
        """These requests no longer run: those of them aborted while they ran."""
        with self.lock:
            ids = set(request_ids)
            aborted = self.aborted & ids
            self.running -= ids
            self.aborted -= ids
            if not self.running:
                self.alone_running = False
                self.lock.notify()
        return aborted

    def finish(self) -> set[str]:
        """The running batch is done: the ids aborted while it ran."""
        with self.lock:  # reentrant: done() takes it too
            return self.done(list(self.running))


class BatchReport(Protocol):
    """What a host does with what the loop reports (called on the loop's thread)."""

    def outputs(self, outputs: list[StageDiffusionCoreOutput]) -> None:
        """The batch's outputs (an aborted request's never among them)."""

    def dropped(self, request_ids: list[str], where: str) -> None:
        """Requests aborted while their batch ran: nothing more comes for them (``where="batch"``)."""

    def progress(
        self, counters: DiffusionCounters, *, force: bool, steps: dict[str, tuple[int, int]] | None = None
    ) -> None:
        """The engine's running count of denoising steps: after each step, and ``force`` after a batch;
        ``steps``: (done, in all) of each request it is working on, for whoever follows one's progress."""

    def preview(self, request_id: str, index: int, image: Any) -> None:
        """A preview a request asked for (``partial_images``): uint8 HxWx3."""


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
        engine.on_preview = self._preview
        self._thread: threading.Thread | None = None
        """The thread that serves (reports go out from it alone)."""
        self._step_ran: list[str] | None = None
        """``batching: loop``: the requests its last step ran."""
        self._step_loop: Any = None
        """``batching: loop``: the stage's step loop (its requests' steps are its own)."""

    def _request_steps(self) -> dict[str, tuple[int, int]]:
        """(done, in all) of the steps of each request being denoised."""
        steps = self.engine.request_steps()
        loop = self._step_loop
        if loop is not None:
            steps.update({i.request_id: (i.done_steps, i.total_steps) for i in loop.running if i.total_steps})
        return steps

    def _step_done(self) -> None:
        if threading.current_thread() is self._thread:
            self._report_previews()
        self.report.progress(self.engine.counters(), force=False, steps=self._request_steps())
        self._hold_at_step()

    def _report_previews(self) -> None:
        """Report the previews other threads handed over (the loop's thread alone reports)."""
        for preview in self.inbox.pop_previews():
            self.report.preview(*preview)

    def _preview(self, request_id: str, index: int, image: Any) -> None:
        """From the loop's thread, reported at once; from another (the preview decoder's, a group's),
        handed to the loop's, which reports it at its next step end or before the call's outputs."""
        if threading.current_thread() is self._thread:
            self.report.preview(request_id, index, image)
        else:
            self.inbox.preview(request_id, index, image)
        inbox = self.inbox
        hold_point("dit.preview", request_id, give_up=lambda: inbox.stopping)

    def _hold_at_step(self, step: int = 0) -> None:
        """Tests hold the running batch (or group) here, after a denoising step (off unless armed); with
        ``batching: loop`` what is held is what the step ran (a preempted request is not)."""
        inbox = self.inbox
        held = self._step_ran if self._step_ran is not None else sorted(inbox.running)
        hold_point("dit.step", " ".join(held), give_up=lambda: inbox.stopping)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Abort requests: those still queued are dropped with their payloads (their ids returned, for
        the host to report as dropped from the queue); running ones get no image."""
        dropped = self.inbox.abort(request_ids)
        if self.input_connector is not None:
            for request in dropped:
                release(request.diffusion, self.input_connector)
        return [r.request_id for r in dropped]

    def serve(self) -> None:
        """Run batches (or groups, with ``batching: step``) until the inbox stops."""
        self._thread = threading.current_thread()
        try:
            if self.engine.step_batcher is not None:
                self._serve_groups()
                return
            if self.engine.step_family is not None:
                self._serve_loop()
                return
            while not self.inbox.stopping:
                batch = self.inbox.take(self.max_batch)
                self.engine.count_started(self.inbox.started_waits())
                if batch:
                    self.run_batch(batch)
        finally:
            self.inbox.closed = True
            self.engine.close()

    def _serve_groups(self) -> None:
        """``batching: step``: what is queued starts at once while fewer than ``max_batch`` requests run,
        as groups of compatible requests, each a pipeline call on a thread of its own whose denoiser calls
        share forwards with the other groups'; a group's outputs are reported as soon as it is done.
        Groups taken start while those in flight keep, together, to the memory budget and to
        ``max_step_tokens`` (:class:`GroupBudget`).
        Stopping starts nothing new and lets the taken groups finish (interrupted: aborts them)."""
        inbox, engine = self.inbox, self.engine
        groups: dict[str, tuple[threading.Thread, int]] = {}
        memory = engine.memory.activation_bytes if engine.memory is not None else None
        budget = GroupBudget((memory, engine.activation_bytes), (engine.max_step_tokens, engine.step_tokens))
        transfer: dict[str, float] = {}
        reported = engine.counters()
        while not inbox.stopping or groups or budget.waiting:
            running = sum(size for _, size in groups.values()) + budget.waiting_rows
            taken = inbox.take_rows(self.max_batch - running, engine.batch_wait_ms / 1000)
            budget.admit(self._admit(taken, transfer))
            self._report_previews()
            finished = inbox.pop_finished()
            counters = engine.counters()
            if counters != reported or finished:  # forced before outputs: /metrics counts what they ran
                reported = counters
                self.report.progress(counters, force=bool(finished), steps=self._request_steps())
            for key, results in finished:
                groups.pop(key)[0].join()
                budget.done(key)
                aborted = inbox.done([r.request_id for r in results])
                outputs = []
                for result in results:
                    seconds = transfer.pop(result.request_id, 0.0)
                    if result.aborted or result.request_id in aborted or inbox.interrupted:
                        if not inbox.interrupted:
                            self.report.dropped([result.request_id], "batch")
                        continue
                    outputs.append(self._output_of(result, seconds))
                if outputs:
                    self.report.outputs(outputs)
            for group in budget.start(group_key):
                key = group_key(group)
                thread = threading.Thread(
                    target=self._run_group, args=(key, group), name="dit-group", daemon=True
                )
                groups[key] = (thread, len(group))
                thread.start()

    def _serve_loop(self) -> None:
        """``batching: loop``: one step loop over every admitted request's rows (``diffusion/step_loop.py``).
        Arrivals join at the next step while fewer than ``max_batch`` requests are admitted, in waves
        (once as many wait as half the free places, or the first has waited ``batch_wait_ms``) so that
        their prompts encode together; a request of better priority than one admitted joins beyond that
        (up to ``max_batch`` parked), and the step's row budget (two per request in ``max_batch``) leaves
        the worse out until it is done. Requests the family cannot run step-wise (an edit of several
        source images, or whose strength leaves it no step) run as whole requests between steps.
        Finished requests decode beside the next steps (``overlap_decode``; ``DecodeBeside``) and are
        reported after the step during which their decode ended; a test that holds the loop at
        ``dit.step`` sees every decode begun before the held step reported. Stopping admits nothing
        new and lets the admitted requests finish (interrupted: drops them)."""
        import torch

        from vllm_omni_plugin.diffusion.parking import StateParking
        from vllm_omni_plugin.diffusion.step_loop import DecodeBeside, StepLoop

        inbox, engine = self.inbox, self.engine
        family = engine.step_family
        tokens: dict[str, int] = {}
        budgets = [(engine.max_step_tokens, lambda r: tokens[r.request_id])]
        memory: dict[str, int] = {}
        if engine.memory is not None:
            budgets.append((engine.memory.activation_bytes, lambda r: memory[r.request_id]))
        decoder = DecodeBeside(engine.device) if engine.overlap_decode else None
        parking = None
        if engine.memory is not None and engine.device.type != "cpu":  # a CPU's host memory is its device's
            parking = StateParking(
                engine.device, engine.memory.activation_bytes, lambda r: memory[r.request_id]
            )
        loop = StepLoop(family, 2 * self.max_batch, budgets=budgets, decoder=decoder, parking=parking)
        self._step_loop = loop
        transfer: dict[str, float] = {}
        started: dict[str, float] = {}

        def drop(request_id: str) -> None:
            """An aborted request leaves (interrupted: silently)."""
            for kept in (tokens, memory, transfer, started):
                kept.pop(request_id, None)
            inbox.done([request_id])
            if not inbox.interrupted:
                self.report.dropped([request_id], "batch")

        while not inbox.stopping or not loop.idle():
            admitted = self._admit(self._loop_arrivals(loop), transfer)
            whole = []
            for request in (r for group in admitted for r in group):
                if family.runs(request):
                    tokens[request.request_id] = engine.step_tokens([request])
                    if engine.memory is not None:
                        memory[request.request_id] = engine.activation_bytes([request])
                    loop.add(request.request_id, request, priority=request.priority)
                    started[request.request_id] = time.perf_counter()
                else:
                    whole.append(request)
            if whole:
                self._run_whole(whole, {r.request_id: transfer.pop(r.request_id, 0.0) for r in whole})
            for item in [*loop.waiting, *loop.running]:
                if inbox.is_aborted(item.request_id) or inbox.interrupted:
                    loop.abort(item.request_id)
                    drop(item.request_id)
            if loop.idle():
                continue
            preempted, parked = loop.counters.preemptions, loop.counters.parked
            began = time.perf_counter()
            with torch.no_grad():  # as a pipeline's call: compiled blocks' graphs guard on the grad mode
                finished = loop.step()
            stepped = bool(loop.ran)  # else it only waited for the last requests' decoder call
            if stepped:
                self._step_ran = loop.ran
                engine.count_loop_step(
                    len(loop.ran),
                    time.perf_counter() - began,
                    loop.counters.preemptions - preempted,
                    loop.counters.parked - parked,
                )
                if hold_armed("dit.step"):  # a held step has reported every image decoded before it
                    finished += loop.drain_decodes()
            outputs, timings = [], []
            for done in finished:
                if inbox.is_aborted(done.request_id) or inbox.interrupted:  # while it decoded
                    drop(done.request_id)
                    continue
                tokens.pop(done.request_id, None)
                memory.pop(done.request_id, None)
                phases = done.seconds
                timing = {
                    "encode": phases.get("encode", 0.0),
                    "denoise": phases.get("encode", 0.0) + phases.get("steps", 0.0),
                    "decode": phases.get("decode", 0.0),
                    "total": time.perf_counter() - started.pop(done.request_id),
                }
                timings.append(timing)
                result = DiffusionResult(
                    request_id=done.request_id, image=done.image, seed=done.request.seed, timings=timing,
                    latents=done.latents,
                )  # fmt: skip
                outputs.append(self._output_of(result, transfer.pop(done.request_id, 0.0)))
            if outputs:
                engine.count_loop_finished(timings)
                inbox.done([o.request_id for o in outputs])
                self._report_previews()  # those the preview decoder handed over come before the images
                self.report.progress(engine.counters(), force=True, steps=self._request_steps())
                self.report.outputs(outputs)
            if stepped:
                self._step_done()  # holds at dit.step, after the step's answers went out

    def _admit(self, taken: list[StageDiffusionCoreRequest], transfer: dict[str, float]) -> list[list[Any]]:
        """The engine's groups of the taken requests (their payloads read; ``transfer``: each one's read
        seconds); those it cannot run are reported failed at once."""
        engine = self.engine
        engine.count_started(self.inbox.started_waits())
        requests, failed = [], []
        for message in taken:
            request, seconds, bad = self._request_of(message)
            if bad is None:
                requests.append(request)
                transfer[message.request_id] = seconds
            else:
                failed.append(bad)
        admitted, refused = engine.admit(requests) if requests else ([], [])
        fault_point(r.seed for group in admitted for r in group)
        failed += [self._output_of(r, transfer.pop(r.request_id, 0.0)) for r in refused]
        if failed:
            self.inbox.done([o.request_id for o in failed])
            self.report.outputs(failed)
        return admitted

    def _loop_arrivals(self, loop: Any) -> list[StageDiffusionCoreRequest]:
        """The queued requests that join the step loop now (never waiting while it has work)."""
        inbox = self.inbox
        admitted = len(loop.running) + len(loop.waiting)
        free = self.max_batch - admitted
        if loop.idle():
            return inbox.take_rows(free)
        if not inbox.queued or inbox.stopping:
            return []
        if free > 0:
            waited = time.monotonic() - inbox.arrived.get(inbox.queued[0].request_id, 0.0)
            if len(inbox.queued) >= max(1, free // 2) or waited >= self.engine.batch_wait_ms / 1000:
                return inbox.take_rows(free)
            return []
        worst = max(item.priority for item in [*loop.running, *loop.waiting])
        if admitted < 2 * self.max_batch and queued_priority(inbox.queued[0]) < worst:
            return inbox.take_rows(1)  # it preempts: the worse wait, parked, until it is done
        return []

    def _run_whole(self, requests: list[Any], transfer: dict[str, float]) -> None:
        """Requests the step loop cannot run, run as whole requests (batched as the engine batches them)
        between its steps."""
        self._step_ran = None  # their steps hold at dit.step as a batch's do
        inbox = self.inbox
        results = self.engine.generate(requests, inbox.is_aborted)
        aborted = {r.request_id for r in results if r.aborted or inbox.is_aborted(r.request_id)}
        outputs = [self._output_of(r, transfer[r.request_id]) for r in results if r.request_id not in aborted]
        self._report_call(outputs, aborted, lambda: inbox.done([r.request_id for r in requests]))

    def _run_group(self, key: str, group: list[Any]) -> None:
        results: list[Any] = []
        try:
            results = self.engine.run_group(group, self.inbox.is_aborted, self._hold_at_step)
        finally:  # the engine turns its errors into failed results; anything else still ends the group
            if len(results) != len(group):
                error = "the diffusion stage's group thread ended without results"
                results = [DiffusionResult(request_id=r.request_id, error=error) for r in group]
            self.inbox.group_done(key, results)

    def run_batch(self, batch: list[StageDiffusionCoreRequest]) -> None:
        outputs, aborted = self._run(batch)
        self._report_call(outputs, aborted, self.inbox.finish)

    def _report_call(
        self, outputs: list[StageDiffusionCoreOutput], aborted: set[str], finish: Callable[[], set[str]]
    ) -> None:
        """Report one engine call's outputs once its previews are out (``finish``: its requests no longer
        run; returns those aborted while they ran): the aborted are dropped (an image already put for one
        freed), the rest reported."""
        self._report_previews()  # every preview of the call is in: a call returns after its previews
        aborted = aborted | finish()
        self.report.progress(self.engine.counters(), force=True, steps=self._request_steps())
        connector = self.output_connector
        for output in outputs:
            if output.request_id in aborted and output.image_handle is not None and connector is not None:
                # aborted after its image was put: nobody will read it
                connector.cleanup(msgspec.convert(output.image_handle, ConnectorHandle))
        outputs = [o for o in outputs if o.request_id not in aborted]
        if outputs:
            self.report.outputs(outputs)
        if aborted and not self.inbox.interrupted:
            self.report.dropped(sorted(aborted), "batch")

    def _run(self, batch: list[StageDiffusionCoreRequest]) -> tuple[list[StageDiffusionCoreOutput], set[str]]:
        """Outputs of the batch's requests (images put through the output connector), and the ids of
        those aborted before their image was made."""
        engine, is_aborted = self.engine, self.inbox.is_aborted
        requests = []
        transfer: dict[str, float] = {}
        outputs: dict[str, StageDiffusionCoreOutput] = {}
        for message in batch:
            request, transfer[message.request_id], failed = self._request_of(message)
            if failed is not None:
                outputs[message.request_id] = failed
            else:
                requests.append(request)
        fault_point(r.seed for r in requests)
        results = engine.generate(requests, is_aborted) if requests else []
        aborted: set[str] = set()
        for result in results:
            if result.aborted or is_aborted(result.request_id):
                aborted.add(result.request_id)
                continue
            outputs[result.request_id] = self._output_of(result, transfer[result.request_id])
        return [outputs[m.request_id] for m in batch if m.request_id in outputs], aborted

    def _request_of(
        self, message: StageDiffusionCoreRequest
    ) -> tuple[Any, float, StageDiffusionCoreOutput | None]:
        """The engine's request of a message (its payload read through the input connector), the
        seconds that read took, and the failed output instead when the payload is bad or lost."""
        transfer = 0.0
        try:
            fields = message.diffusion
            if self.input_connector is not None:
                t0 = time.perf_counter()
                fields = internalize(fields, self.input_connector)
                transfer = time.perf_counter() - t0
            return msgspec.convert(fields, self.engine.request_type), transfer, None
        except Exception as exc:  # a bad or lost payload fails this request only
            failed = StageDiffusionCoreOutput(
                request_id=message.request_id,
                stage_id=self.stage_id,
                error=f"bad diffusion request: {exc}",
                invalid=isinstance(exc, msgspec.ValidationError),
            )
            return None, transfer, failed

    def _output_of(self, result: DiffusionResult, transfer: float) -> StageDiffusionCoreOutput:
        """A result as the stage's output, its image put through the output connector."""
        out = StageDiffusionCoreOutput(
            request_id=result.request_id,
            stage_id=self.stage_id,
            error=result.error,
            invalid=result.invalid,
            timings={**(result.timings or {}), "transfer_in": transfer},
            latents=result.latents,
        )
        if result.error is None:
            if self.output_connector is not None:
                handle = self.output_connector.put(image_tensor(result.image))
                out.image_handle = msgspec.to_builtins(handle)
            else:
                out.image = result.image
        return out


def image_tensor(image: Any) -> Any:
    """An image array as the uint8 tensor a connector takes."""
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(np.asarray(image, dtype=np.uint8)))
