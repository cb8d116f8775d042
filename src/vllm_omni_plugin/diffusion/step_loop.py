"""One denoising loop for a diffusion stage (``batching: loop``): schedule -> execute -> update, one step at
a time, over every admitted request's rows.

The loop owns each admitted request's denoising state (its family's latents, scheduler copy, generator
draws and conditioning) and runs the stage as vLLM's engine core runs tokens:

- **schedule**: the requests of the best priority present (lower value first: vLLM's
  ``--scheduling-policy priority`` convention) are taken in arrival order while they fit the step's budgets,
  the waiting ones among them admitted (their prompts encoded together, in one encoder call); a running
  request left out (of a worse priority, or past the budgets) is preempted for this step: its state stays
  as it is (or, where the memory budget needs its room on an accelerator, is parked in host memory:
  ``diffusion/parking.py``) and it resumes where it stopped, with the image it would have got. A better
  request thus runs as if alone while it runs;
- **execute**: one forward per group of rows that can share one (equal shape key: same image size), each
  request's guidance and scheduler step on its own rows;
- **update**: finished requests leave, decoded together; with a :class:`DecodeBeside`, their decoder call
  runs on a thread of its own beside the next steps (the loop's forwards and the decoder's convolutions
  share the device), and the first step after it is done returns their images; requests that finish
  while it is busy decode together in the next call (a video's decode lasts many steps). With nothing
  left to step, or only requests of a worse priority, they decode at once.

Features that act on the requests asking for them attach as :class:`LoopLayer` s of the family (its
``layers``): LoRA adapters per request and previews are two. The loop tells each layer which requests are
admitted and which left, and lets it settle before finished requests decode; the family's forwards run
through each layer's ``wrap`` (which knows the state each row belongs to), call the denoiser its
``denoiser`` gives (CFG and sequence parallelism: the replica's group computes the forward), and each
scheduler step is shown to its ``stepped``. A family's states keep their step as ``index``, their schedule
as ``timesteps`` and their latents (one row) as ``latents``.

A request's image does not depend on the rows beside it, up to the float noise of a batched kernel (at most
1/255): each keeps its own generator draws, scheduler and guidance.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from vllm_omni_plugin.diffusion.parking import Parked, StateParking

Forward = Callable[[list[Any], dict[str, Any]], Any]
"""One denoiser forward: the state each row belongs to, and the denoiser's inputs (one row each)."""


class LoopLayer:
    """A feature acting on the requests that ask for it, as one layer of a family's pieces: the loop tells
    it which requests are admitted and which left and has it settle before finished requests decode; the
    family runs each forward through it and shows it each request's scheduler step. Each hook does
    nothing unless the feature needs it."""

    field: ClassVar[str] = ""
    """The request field whose ask this layer serves (``lora``, ``partial_images``)."""

    def serves(self, request: Any) -> bool:
        """Whether the request asks something of this layer."""
        return bool(self.field) and bool(getattr(request, self.field, None))

    def admit(self, request: Any, state: Any) -> None:
        """The request joins the loop with this state: remember what it asks."""

    def leave(self, state: Any) -> None:
        """The state's request finished or was aborted."""

    def wrap(self, call: Forward) -> Forward:
        """The forward with this layer around it (a family composes its layers' wraps once per forward,
        the last layer outermost)."""
        return call

    def denoiser(self, module: Any) -> Any:
        """What the family's forwards call in place of its denoiser ``module`` (a parallel replica's
        stand-in, which computes the forward's rows or tokens over its group); ``module`` itself unless
        the layer computes forwards elsewhere."""
        return module

    def answer(self, state: Any) -> Any | None:
        """The state's (guided) model output for its step in place of the forward's, its rows left out
        of the forward (families whose whole call caches a step's guided output ask it: BAGEL); None:
        the forward computes it."""
        return None

    def stepped(self, state: Any, sample: Any, output: Any) -> None:
        """The state's scheduler stepped from ``sample`` with the (guided) model ``output``; the state's
        ``index`` is still the step that ran."""

    def settle(self) -> None:
        """Before finished requests decode: what the layer does beside the steps is done."""


LOOP_ASKS: dict[str, Callable[[Any], bool]] = {
    "images": lambda r: bool(getattr(r, "image_to_image", False)),
    "mask": lambda r: getattr(r, "mask", None) is not None,
    "lora": lambda r: getattr(r, "lora", None) is not None,
    "partial_images": lambda r: bool(getattr(r, "partial_images", 0)),
    "cache": lambda r: getattr(r, "cache", None) is not None and r.cache.active,
}
"""What a request may ask that the step loop runs only where one of the family's layers (by its
``field``) or the family itself serves it; the stage runs the others as whole requests."""


def runs_in_loop(request: Any, layers: Sequence[LoopLayer], own: Sequence[str] = ()) -> bool:
    """Whether the loop runs the request: each of its asks (source images, an adapter, previews, step
    caching) served by one of ``layers`` or by the family itself (``own``). Final latents the loop
    returns itself."""
    served = {layer.field for layer in layers} | set(own)
    return not any(asks(request) for name, asks in LOOP_ASKS.items() if name not in served)


def through_layers(layers: Sequence[LoopLayer], call: Forward) -> Forward:
    """``call`` wrapped by every layer, the last outermost: a family's one seam for its forwards."""
    for layer in layers:
        call = layer.wrap(call)
    return call


def denoiser_through(layers: Sequence[LoopLayer], module: Any) -> Any:
    """The denoiser a family's innermost forward calls: ``module`` as every layer's :meth:`LoopLayer.denoiser`
    gives it, the last outermost."""
    for layer in layers:
        module = layer.denoiser(module)
    return module


def decoded_by_group(
    states: list[Any], key: Callable[[Any], Hashable], decode: Callable[[Hashable, list[Any]], list[Any]]
) -> list[Any]:
    """Each state's image, from one ``decode(key, states)`` call per group of states with equal ``key``
    (their image size), in the states' order."""
    groups: dict[Hashable, list[int]] = {}
    for k, state in enumerate(states):
        groups.setdefault(key(state), []).append(k)
    images: dict[int, Any] = {}
    for group_key, members in groups.items():
        for k, image in zip(members, decode(group_key, [states[k] for k in members]), strict=True):
            images[k] = image
    return [images[k] for k in range(len(states))]


class StepFamily(Protocol):
    """What the loop needs of a pipeline family, built from the pipeline's own components."""

    layers: list[LoopLayer]
    """Features acting on the requests that ask for them (:class:`LoopLayer`)."""

    def runs(self, request: Any) -> bool:
        """Whether the loop can run the request (the stage runs the others as whole requests)."""

    def encode(self, requests: list[Any]) -> list[Any]:
        """Each request's conditioning, from one encoder call for all of them."""

    def prepare(self, request: Any, conditioning: Any) -> Any:
        """The request's denoising state (initial latents from its generator, its scheduler's timesteps)."""

    def steps(self, state: Any) -> int:
        """How many denoising steps the state takes."""

    def rows(self, request: Any) -> int:
        """Rows the request adds to a forward (2 with classifier-free guidance)."""

    def shape(self, state: Any) -> Hashable:
        """States with equal keys can share a forward."""

    def denoise(self, states: list[Any]) -> None:
        """One forward over these states' rows, then each state's guidance and scheduler step."""

    def decode(self, states: list[Any]) -> list[Any]:
        """The finished states' images, from one decoder call."""

    def estimate(self, state: Any, sample: Any, output: Any) -> Any:
        """The clean latents a step from ``sample`` with ``output`` estimates (what a preview shows)."""


class ConditioningCache:
    """Encoded inputs by key (a text; a source image's digest), the most recently used kept within
    ``max_bytes``: the negative prompt most guided requests share, prompts asked again and an image
    edited again are encoded once. Entries are the encoder's own output for the input, so a request's
    conditioning is what the pipeline computes for it."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.bytes = 0

    def get(self, texts: Sequence[str], encode: Callable[[list[str]], list[Any]]) -> list[Any]:
        """Each text's conditioning; those not cached come from one ``encode`` call (each text once)."""
        missing = list(dict.fromkeys(t for t in texts if t not in self.entries))
        fresh = dict(zip(missing, encode(missing), strict=True)) if missing else {}
        out = []
        for text in texts:
            if text in fresh:
                out.append(fresh[text])
            else:
                self.entries.move_to_end(text)
                out.append(self.entries[text][0])
        for text, value in fresh.items():
            self._keep(text, value)
        return out

    def _keep(self, text: str, value: Any) -> None:
        size = sum(t.numel() * t.element_size() for t in value if hasattr(t, "numel"))
        if size > self.max_bytes:
            return
        self.entries[text] = (value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self.entries.popitem(last=False)
            self.bytes -= dropped


@dataclass(eq=False)
class Denoising:
    """One request in the loop."""

    request_id: str
    request: Any
    priority: int
    arrival: int
    state: Any = None
    done_steps: int = 0
    total_steps: int = 0
    preemptions: int = 0
    parked: Parked | None = None
    """Where its state's tensors wait in host memory while it is preempted (``StateParking``)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """This request's phases: its wave's encoding, the forwards it was in, its decoder call."""

    def order(self) -> tuple[int, int]:
        return self.priority, self.arrival


@dataclass
class Finished:
    request_id: str
    request: Any
    image: Any
    preemptions: int
    seconds: dict[str, float] = field(default_factory=dict)
    latents: Any = None
    """Its final latents before decoding (one row, on the CPU), where it asked (``return_latents``)."""


@dataclass
class LoopCounters:
    steps: int = 0
    preemptions: int = 0
    encoder_calls: int = 0
    parked: int = 0
    """States parked in host memory (``StateParking``)."""


class DecodeBeside:
    """Runs a loop's decoder calls on one thread of its own, each beside the step that follows it: under
    ``no_grad`` as the loop's forwards (the mode is per thread) and, on a CUDA device, on a stream of its
    own that first waits for what the loop's stream had queued when the call was handed over."""

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self._stream: Any = None

    def submit(self, decode: Callable[[], list[Any]]) -> Future[tuple[list[Any], float]]:
        """``decode()`` begun on the decoder's thread: its images and the seconds the call took."""
        import torch

        future: Future[tuple[list[Any], float]] = Future()
        cuda = getattr(self.device, "type", None) == "cuda"
        ready = None
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device)
            ready = torch.cuda.Event()
            ready.record()  # the latents' last step, on the loop's stream

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                began = time.perf_counter()
                with torch.no_grad():
                    if ready is not None:
                        with torch.cuda.stream(self._stream):
                            self._stream.wait_event(ready)
                            images = decode()
                    else:
                        images = decode()
                future.set_result((images, time.perf_counter() - began))
            except BaseException as exc:  # raised where the loop waits for it
                future.set_exception(exc)

        threading.Thread(target=run, name="dit-decode", daemon=True).start()
        return future


@dataclass
class Decoding:
    """Finished requests whose decoder call runs beside the next steps."""

    items: list[Denoising]
    images: Future[tuple[list[Any], float]]


Budget = tuple[int, Callable[[Any], int]]
"""A limit on one step and what a request needs of it (the stage's ``max_step_tokens`` and a request's
latent tokens; its memory budget and a request's activations)."""


@dataclass
class StepLoop:
    """The loop over one family's requests; ``max_rows``: the rows one step's forwards may hold in all;
    ``budgets``: other limits each step keeps to. A request that fits no step beside others runs alone."""

    family: StepFamily
    max_rows: int
    budgets: list[Budget] = field(default_factory=list)
    decoder: DecodeBeside | None = None
    """Where finished requests decode beside the next steps (None: at once, after the step that finished
    them)."""
    parking: StateParking | None = None
    """Where preempted states wait while the memory budget needs their room (None: they stay)."""
    waiting: list[Denoising] = field(default_factory=list)
    running: list[Denoising] = field(default_factory=list)
    counters: LoopCounters = field(default_factory=LoopCounters)
    ran: list[str] = field(default_factory=list)
    """The requests the last step ran."""
    decoding: Decoding | None = None
    """The finished requests whose decoder call runs beside the steps."""
    to_decode: list[Denoising] = field(default_factory=list)
    """Finished requests waiting for the decoder (busy with earlier ones): they decode together next."""
    _arrivals: itertools.count = field(default_factory=itertools.count)

    def add(self, request_id: str, request: Any, priority: int = 0) -> None:
        self.waiting.append(Denoising(request_id, request, priority, next(self._arrivals)))

    def abort(self, request_id: str) -> bool:
        """Drop the request wherever it is; its rows leave the next step."""
        for queue in (self.waiting, self.running):
            for item in queue:
                if item.request_id == request_id:
                    queue.remove(item)
                    self._left(item)
                    return True
        return False

    def _left(self, item: Denoising) -> None:
        if item.state is not None:
            for layer in self.family.layers:
                layer.leave(item.state)

    def idle(self) -> bool:
        return not self.waiting and not self.running and self.decoding is None and not self.to_decode

    def _schedule(self) -> list[Denoising]:
        """Admit what fits after what is ahead of it, then pick this step's requests."""
        candidates = sorted(self.running + self.waiting, key=Denoising.order)
        if candidates:  # the best priority present runs as if alone: the worse wait, parked, meanwhile
            candidates = [c for c in candidates if c.priority == candidates[0].priority]
        limits = [(self.max_rows, self.family.rows), *self.budgets]
        used = [0] * len(limits)
        chosen: list[Denoising] = []
        new: list[Denoising] = []
        for item in candidates:
            needs = [need(item.request) for _, need in limits]
            if chosen and any(u + n > limit for (limit, _), u, n in zip(limits, used, needs, strict=True)):
                continue
            used = [u + n for u, n in zip(used, needs, strict=True)]
            chosen.append(item)
            if item.state is None:
                new.append(item)
        if new:
            began = time.perf_counter()
            conditionings = self.family.encode([item.request for item in new])
            self.counters.encoder_calls += 1
            for item, conditioning in zip(new, conditionings, strict=True):
                item.state = self.family.prepare(item.request, conditioning)
                for layer in self.family.layers:
                    layer.admit(item.request, item.state)
                item.total_steps = self.family.steps(item.state)
                self.waiting.remove(item)
                self.running.append(item)
            for item in new:
                item.seconds["encode"] = time.perf_counter() - began
        for item in self.running:
            if item not in chosen:
                item.preemptions += 1
                self.counters.preemptions += 1
        if self.parking is not None:
            self._park(chosen)
        return chosen

    def _park(self, chosen: list[Denoising]) -> None:
        """The chosen requests' parked states back on the device; then, while the states on the device and
        this step's activations exceed the memory budget's room, the worst preempted states parked."""
        parking = self.parking
        assert parking is not None
        for item in chosen:
            if item.parked is not None:
                parking.resume(item.state, item.parked)
                item.parked = None
        resident = [item for item in self.running if item.parked is None]
        preempted = sorted((i for i in resident if i not in chosen), key=Denoising.order, reverse=True)
        if not preempted:  # nothing to park: the states are not walked
            return
        need = sum(parking.need(item.request) for item in chosen)
        used = parking.resident_bytes(item.state for item in resident)
        for item in preempted:
            if used + need <= parking.room:
                break
            resident.remove(item)
            item.parked = parking.park(item.state, kept=[other.state for other in resident])
            used -= item.parked.bytes
            self.counters.parked += 1

    def step(self) -> list[Finished]:
        """One iteration: schedule, one forward per shape group, then decode what finished; what returns is
        what finished decoding. With a decoder, finished requests decode on its thread while the steps go
        on, and those that finish while it is busy decode together once it is free (a video's decode
        takes many steps' time); with no step to run beside it, the iteration waits for the decoder."""
        chosen = self._schedule()
        self.ran = [item.request_id for item in chosen]
        groups: dict[Hashable, list[Denoising]] = {}
        for item in chosen:
            groups.setdefault(self.family.shape(item.state), []).append(item)
        for group in groups.values():
            forward = time.perf_counter()
            self.family.denoise([item.state for item in group])
            for item in group:
                item.done_steps += 1
                item.seconds["steps"] = item.seconds.get("steps", 0.0) + time.perf_counter() - forward
        if chosen:
            self.counters.steps += 1
        finished = self._decoded(wait=not chosen)
        done = [item for item in self.running if item.done_steps >= item.total_steps]
        if done:
            for item in done:
                self.running.remove(item)
                self._left(item)
            for layer in self.family.layers:
                layer.settle()
            self.to_decode += done
            if self.decoder is None or not self._decodes_beside(done):
                finished += self.drain_decodes()  # at once, after the decoder's call (one at a time)
        if self.decoder is not None and self.decoding is None and self.to_decode:
            items, self.to_decode = self.to_decode, []
            states = [item.state for item in items]
            self.decoding = Decoding(items, self.decoder.submit(lambda: self.family.decode(states)))
        return finished

    def drain_decodes(self) -> list[Finished]:
        """Every finished request's image now: the decoder's call in flight waited for, those waiting for
        it decoded at once (a loop about to be held between steps leaves nothing decoding)."""
        finished = self._decoded(wait=True)
        if self.to_decode:
            finished += self._decode(self.to_decode)
            self.to_decode = []
        return finished

    def _decode(self, items: list[Denoising]) -> list[Finished]:
        began = time.perf_counter()
        images = self.family.decode([item.state for item in items])
        return self._finished(items, images, time.perf_counter() - began)

    def _decodes_beside(self, done: list[Denoising]) -> bool:
        """Finished requests decode beside the next steps where one follows that runs requests of their
        priority or better; requests that preempted worse ones decode at once, their answers not kept
        waiting for the worse ones' step."""
        left = [item.priority for item in (*self.running, *self.waiting)]
        return bool(left) and min(left) <= min(item.priority for item in done)

    def _decoded(self, wait: bool) -> list[Finished]:
        """The requests whose decoder call is done (``wait``: waited for, where one runs)."""
        decoding = self.decoding
        if decoding is None or (not wait and not decoding.images.done()):
            return []
        self.decoding = None
        return self._finished(decoding.items, *decoding.images.result())

    def _finished(self, items: list[Denoising], images: list[Any], seconds: float) -> list[Finished]:
        for item in items:
            item.seconds["decode"] = seconds
        return [
            Finished(item.request_id, item.request, image, item.preemptions, item.seconds, latents_of(item))
            for item, image in zip(items, images, strict=True)
        ]


def run_whole(
    family: StepFamily,
    requests: Sequence[Any],
    on_step: Callable[[int], None] | None = None,
    on_denoised: Callable[[], None] | None = None,
) -> tuple[list[Any], dict[str, float]]:
    """Whole-request batching on a family's pieces: ``requests`` prepared together, then each step one
    forward per shape group over the rows of all that are not done, until every one is, then decoded
    together; the family's layers act as in the loop. ``on_denoised()`` after the last step, before the
    layers settle and the decode; ``on_step(step)`` after each step (it may raise to stop the call).
    Returns the images in request order and the call's ``denoise``/``decode``/``total`` seconds."""
    began = time.perf_counter()
    states = [
        family.prepare(request, conditioning)
        for request, conditioning in zip(requests, family.encode(list(requests)), strict=True)
    ]
    try:
        for request, state in zip(requests, states, strict=True):
            for layer in family.layers:
                layer.admit(request, state)
        running, step = list(states), 0
        while running:
            groups: dict[Hashable, list[Any]] = {}
            for state in running:
                groups.setdefault(family.shape(state), []).append(state)
            for group in groups.values():
                family.denoise(group)
            running = [state for state in running if state.index < family.steps(state)]
            if not running and on_denoised is not None:
                on_denoised()
            if on_step is not None:
                on_step(step)
            step += 1
        for layer in family.layers:
            layer.settle()
        denoised = time.perf_counter()
        images = family.decode(states)
    except BaseException:
        for layer in family.layers:  # what a layer does beside the steps ends with the call (its previews)
            layer.settle()
        raise
    finally:
        for state in states:
            for layer in family.layers:
                layer.leave(state)
    end = time.perf_counter()
    return images, {"denoise": denoised - began, "decode": end - denoised, "total": end - began}


def latents_of(item: Denoising) -> Any:
    """A finished request's latents (a family's states keep them as ``latents``, one row), where it asked."""
    if not getattr(item.request, "return_latents", False):
        return None
    return item.state.latents[0].detach().to("cpu").clone()
