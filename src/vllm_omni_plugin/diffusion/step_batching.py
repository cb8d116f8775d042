"""Step-level batching: the denoiser calls of requests running at once become one forward per step.

Each request runs its own pipeline call on its own thread (its own scheduler, generator, guidance and
step count); the denoiser those calls reach is a :class:`StepBatcher` proxy. A call waits there until
every request that is denoising has its next call waiting too (a step boundary); then the step thread
runs the waiting calls that can share a forward as one (their per-row tensors concatenated, rows of a
call kept together, so a classifier-free guidance pair stays one), and hands each caller its rows of the
result. A request that starts denoising joins at the next boundary, one that finishes or is aborted
leaves at once (:meth:`StepBatcher.leave`), and prompt encoding and VAE decode of other requests go on
while the step runs: they are not calls to the denoiser.

The same machinery joins the VAE decodes of groups (:class:`DecodeCalls`, :class:`GroupVae`): a decode is a
one-off call that waits for no other row, so the decode thread runs what is waiting as soon as it is
free, and decodes that came while it was busy run as one call (a VAE decodes a few images in little
more than one's time).

Calls share a forward only when everything that is not per row is equal (shared tensors such as FLUX's
position ids compared by value, other arguments by ``==``); per-row values are tensors and lists whose
first dimension is the call's rows. An argument that is neither (GLM-Image's per-request K/V cache of its
source images) is joined by the :class:`ArgumentJoin` its runner declares for it. A request's image is
then the one it gets alone, up to the float noise of a batched kernel (at most 1/255).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)


RUN_AT_ONCE: Hashable = "run at once"
"""An :meth:`ArgumentJoin.key` that takes its call out of step batching: it runs at once on its caller's
thread (a request's one-off preparation, e.g. GLM-Image writing its source images' K/V), not at a step
boundary, where it would put its request a call out of step with the others."""


UNUSED: Hashable = "unused"
"""An :meth:`ArgumentJoin.key` for a value the call does not read (GLM-Image's source-image cache in a
text-to-image call): it joins whatever the others', and the call's rows may be taken apart."""


class ArgumentJoin(Protocol):
    """How a denoiser argument that is neither shared nor a plain per-row value joins across calls."""

    def key(self, value: Any) -> Hashable:
        """Calls share a forward only when their values' keys are equal (:data:`RUN_AT_ONCE`: the call
        runs alone, at once)."""

    def join(self, values: list[Any], rows: list[int]) -> Any:
        """One value for the forward of calls with these values and these rows each, in order."""


class SameValue:
    """An argument every call of a forward must have equal (compared by value), e.g. FLUX's position ids:
    named, because its first dimension can equal the rows of a call by chance (a 64x64 FLUX image has 16
    image tokens; a group of 16 requests has 16 rows)."""

    def key(self, value: Any) -> Hashable:
        if not is_tensor(value):
            return ("value", repr(value))
        return ("tensor", tuple(value.shape), str(value.dtype), value.detach().cpu().numpy().tobytes())

    def join(self, values: list[Any], rows: list[int]) -> Any:
        return values[0]


class RowAborted(Exception):
    """The step batcher was closed (its stage stops): the row's call cannot run."""


@dataclass(slots=True)
class _Call:
    row: str
    rows: int
    kwargs: dict[str, Any]
    since: float
    requests: int
    weight: int = 0
    """Its rows as :attr:`StepBatcher.max_rows` counts them."""
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class StepBatcher:
    """Runs the denoiser calls of concurrent pipeline calls as shared forwards, one step at a time.

    ``module``: the real denoiser. ``max_rows``: the most rows one forward takes (a step with more
    waiting runs several forwards), each row counted ``row_weight(kwargs)`` of its call (default 1: a
    decode counts its latents' size). ``on_forward(requests, rows, seconds)`` is called after each forward
    with the requests it ran (a request's call may be several rows: a guidance pair).
    """

    def __init__(
        self,
        module: Any,
        *,
        max_rows: int,
        on_forward: Callable[[list[str], int, float], None] | None = None,
        joins: Mapping[str, ArgumentJoin] | None = None,
        on_boundary: Callable[[int, float], None] | None = None,
        row_weight: Callable[[dict[str, Any]], int] | None = None,
        name: str = "dit-steps",
    ) -> None:
        self.module = module
        self.row_weight = row_weight
        self.joins: Mapping[str, ArgumentJoin] = joins or {}
        self.max_rows = max(1, max_rows)
        self.on_forward = on_forward
        self.on_boundary = on_boundary
        self._lock = threading.Condition()
        self._denoising: set[str] = set()
        """Rows that made a call and have not left: each boundary waits for all of them."""
        self._waiting: dict[str, _Call] = {}
        self._alive: dict[str, Callable[[], list[bool]]] = {}
        """Per row (a group): which of its requests are still wanted (:meth:`track`)."""
        self._one_off = itertools.count()
        """Numbers the one-off calls' places among the waiting (a row may make several at once)."""
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def proxy(self, row: str, requests: int = 1) -> DenoiserProxy:
        """The denoiser as the pipeline call of ``row`` (of ``requests`` requests) sees it."""
        return DenoiserProxy(self, row, requests)

    def track(self, row: str, alive: Callable[[], list[bool]]) -> None:
        """``alive()``: which of the requests of ``row`` are still wanted, asked at each of its calls. Once
        one is aborted its rows leave the forwards (:func:`live_rows`): the others' rows run without
        them, and the call gets zeros in their place, which its pipeline steps and then drops."""
        self._alive[row] = alive

    def leave(self, row: str) -> None:
        """``row`` makes no further call (its last step is done, it failed, or it ended)."""
        with self._lock:
            self._denoising.discard(row)
            self._alive.pop(row, None)
            self._lock.notify_all()

    def close(self) -> None:
        """Stop the step thread; waiting calls fail."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting.values()), {}
            self._lock.notify_all()
        for call in waiting:
            call.error = RowAborted(call.row)
            call.done.set()
        self._thread.join(timeout=5)

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        """The denoiser's ``forward`` signature (positional arguments are named by it)."""
        return inspect.signature(self.module.forward)

    @property
    def in_flight(self) -> int:
        """Rows denoising now."""
        with self._lock:
            return len(self._denoising)

    # --- the caller's side -------------------------------------------------------------------------

    def call(self, row: str, kwargs: dict[str, Any], requests: int = 1, *, once: bool = False) -> Any:
        """One denoiser call of ``row`` (keyword arguments only, as diffusers pipelines call it); ``once``:
        a one-off call (a decode) that runs at the next boundary without making later ones wait for
        ``row``."""
        if any(join.key(kwargs[name]) == RUN_AT_ONCE for name, join in self.joins.items() if name in kwargs):
            if self._closed:
                raise RowAborted(row)
            return self.module(**kwargs)
        alive = self._alive.get(row)
        keep = live_rows(kwargs, requests, alive(), self.joins) if alive is not None and not once else None
        if keep is not None:
            rows = rows_of(kwargs)
            out = self._queue(row, take_rows(kwargs, keep, rows, self.joins), requests, once)
            return expand_rows(out, keep, rows)
        return self._queue(row, kwargs, requests, once)

    def _queue(self, row: str, kwargs: dict[str, Any], requests: int, once: bool) -> Any:
        """The call waits for its step boundary; its part of the forward's result."""
        rows = rows_of(kwargs)
        weight = rows * (self.row_weight(kwargs) if self.row_weight is not None else 1)
        call = _Call(row, rows, kwargs, time.perf_counter(), requests, weight)
        with self._lock:
            if self._closed:
                raise RowAborted(row)
            if not once:
                self._denoising.add(row)
            self._waiting[f"{row} #{next(self._one_off)}" if once else row] = call
            self._lock.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    # --- the step thread ---------------------------------------------------------------------------

    def _boundary(self) -> list[_Call] | None:
        """The calls of the next step, once every denoising row waits (None: closed)."""
        with self._lock:
            while not self._closed and not (self._waiting and self._denoising <= self._waiting.keys()):
                self._lock.wait()
            if self._closed:
                return None
            calls, self._waiting = list(self._waiting.values()), {}
            return calls

    def _serve(self) -> None:
        import torch

        # the pipelines call their denoiser under no_grad, which is per thread: so must this thread
        with torch.no_grad():
            self._steps()

    def _steps(self) -> None:
        while (calls := self._boundary()) is not None:
            start = time.perf_counter()
            for group in _groups(calls, self.max_rows, self.joins):
                self._forward(group)
            if self.on_boundary is not None:
                self.on_boundary(sum(c.requests for c in calls), time.perf_counter() - start)

    def _forward(self, group: list[_Call]) -> None:
        start = time.perf_counter()
        try:
            kwargs = group[0].kwargs if len(group) == 1 else _joined(group, self.joins)
            out = self.module(**kwargs)
            parts = [out] if len(group) == 1 else _split(out, [c.rows for c in group])
        except BaseException as exc:  # every call of the forward fails with it; the thread goes on
            for call in group:
                call.error = exc
                call.done.set()
            return
        if self.on_forward is not None:
            self.on_forward([c.row for c in group], sum(c.rows for c in group), time.perf_counter() - start)
        for call, part in zip(group, parts, strict=True):
            call.result = part
            call.done.set()


class DenoiserProxy:
    """What a pipeline call sees as its denoiser: calls go through the :class:`StepBatcher`, everything
    else (``config``, ``dtype``, ...) is the real module's."""

    def __init__(self, batcher: StepBatcher, row: str, requests: int) -> None:
        self._batcher = batcher
        self._row = row
        self._requests = requests

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:  # UNet pipelines pass the sample and timestep by position: joined by name
            kwargs = by_name(self._batcher.signature, args, kwargs)
        return self._batcher.call(self._row, kwargs, self._requests)

    @contextlib.contextmanager
    def cache_context(self, name: str) -> Iterator[None]:
        """No cache hooks run on a shared forward: the context a pipeline names changes nothing."""
        yield

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batcher.module, name)


class DecodeCalls:
    """A VAE's ``decode`` as the module a decode :class:`StepBatcher` serves. ``lock``: taken around each
    decode, for VAEs that keep state while they run (their encode and the previews take it too)."""

    def __init__(self, vae: Any, lock: threading.Lock | None = None) -> None:
        self.vae = vae
        self.lock = lock

    @property
    def forward(self) -> Callable[..., Any]:
        """What names a call's positional arguments (:attr:`StepBatcher.signature`)."""
        return self.vae.decode

    def __call__(self, **kwargs: Any) -> Any:
        with self.lock if self.lock is not None else contextlib.nullcontext():
            return self.vae.decode(**kwargs)


def latent_elements(kwargs: dict[str, Any]) -> int:
    """A decode row's weight: the size of one row of its latents."""
    value = kwargs.get("z")
    if not is_tensor(value):
        value = next(v for v in kwargs.values() if is_tensor(v) and v.dim() > 0)
    return int(value[0].numel())


class GroupVae:
    """A group's VAE (``batching: step``): its ``decode`` joins the decodes of other groups through the
    decode batcher; ``encode`` runs under ``lock`` where the VAE keeps state; the rest is the VAE's."""

    def __init__(self, vae: Any, decodes: StepBatcher, row: str, lock: threading.Lock | None) -> None:
        self._vae = vae
        self._decodes = decodes
        self._row = row
        self._lock = lock

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            kwargs = by_name(self._decodes.signature, args, kwargs)
        return self._decodes.call(self._row, kwargs, once=True)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock if self._lock is not None else contextlib.nullcontext():
            return self._vae.encode(*args, **kwargs)

    @property
    def vae_alone(self) -> Any:
        """The VAE itself where it keeps no state (a preview may decode with it at any time), else None."""
        return self._vae if self._lock is None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vae, name)


# --- joining and splitting calls -----------------------------------------------------------------


def by_name(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments, all by keyword."""
    named: dict[str, Any] = {}
    for name, value in signature.bind(*args, **kwargs).arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            raise TypeError("the step batcher cannot join a denoiser's *args")
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def rows_of(kwargs: dict[str, Any]) -> int:
    """A call's rows: the first dimension of its ``hidden_states`` (or its first tensor)."""
    value = kwargs.get("hidden_states")
    if not is_tensor(value):
        value = next((v for v in kwargs.values() if is_tensor(v) and v.dim() > 0), None)
    if value is None:
        raise TypeError("a denoiser call without a tensor argument cannot be batched")
    return int(value.shape[0])


def _per_row(value: Any, rows: int) -> bool:
    if is_tensor(value):
        return value.dim() > 0 and value.shape[0] == rows
    return isinstance(value, list) and len(value) == rows


def live_rows(
    kwargs: dict[str, Any], requests: int, alive: list[bool], joins: Mapping[str, ArgumentJoin]
) -> list[int] | None:
    """The rows of a call of ``requests`` requests that belong to live ones (None: every row runs). A
    call has a row per request, or two with batched guidance (diffusers' ``cat([negative, positive])``:
    request ``i`` is rows ``i`` and ``requests + i``); any other layout, or an argument joined per row
    (an :class:`ArgumentJoin` other than :class:`SameValue`, with a value the call reads) keeps every
    row, as does a call whose every request is aborted (it stops at its step end)."""
    if all(alive) or not any(alive) or len(alive) != requests:
        return None
    for name, join in joins.items():
        value = kwargs.get(name)
        if value is not None and not isinstance(join, SameValue) and join.key(value) != UNUSED:
            return None
    rows = rows_of(kwargs)
    if rows % requests or rows // requests > 2:
        return None
    return [i for i in range(rows) if alive[i % requests]]


def without_unused(kwargs: dict[str, Any], joins: Mapping[str, ArgumentJoin]) -> dict[str, Any]:
    """``kwargs`` with None for each argument its join says the call leaves unused (a cache it skips): the
    call reads None the same way, so a denoiser group's peer is sent that (no object the wire need not
    carry)."""
    return {
        name: None
        if value is not None
        and name in joins
        and not isinstance(joins[name], SameValue)
        and joins[name].key(value) == UNUSED
        else value
        for name, value in kwargs.items()
    }


def take_rows(
    kwargs: dict[str, Any], keep: list[int], rows: int, joins: Mapping[str, ArgumentJoin]
) -> dict[str, Any]:
    """The call's arguments with only the rows ``keep`` (shared values, and the joined ones
    :func:`live_rows` let through, as they are)."""
    taken: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in joins:
            taken[name] = value
        elif is_tensor(value) and _per_row(value, rows):
            import torch

            taken[name] = value.index_select(0, torch.tensor(keep, device=value.device))
        elif isinstance(value, list) and _per_row(value, rows):
            taken[name] = [value[i] for i in keep]
        else:
            taken[name] = value
    return taken


def expand_rows(out: Any, keep: list[int], rows: int) -> Any:
    """A forward's output over the rows ``keep`` as an output over all ``rows``: zeros elsewhere."""
    if is_tensor(out):
        full = out.new_zeros((rows, *out.shape[1:]))
        full[keep] = out
        return full
    if isinstance(out, tuple | list):
        return type(out)(expand_rows(item, keep, rows) if is_tensor(item) else item for item in out)
    if hasattr(out, "to_tuple"):  # a diffusers BaseOutput
        return type(out)(**{key: expand_rows(value, keep, rows) for key, value in out.items()})
    raise TypeError(f"cannot expand a denoiser output of type {type(out).__name__}")


def _signature(call: _Call, joins: Mapping[str, ArgumentJoin]) -> tuple[Any, ...]:
    """What must match for calls to share a forward, besides their shared values (:func:`_same`)."""
    parts: list[Any] = []
    for name in sorted(call.kwargs):
        value = call.kwargs[name]
        if name in joins:
            parts.append((name, "joined", joins[name].key(value)))
        elif _per_row(value, call.rows):
            kind = (tuple(value.shape[1:]), value.dtype, str(value.device)) if is_tensor(value) else "list"
            parts.append((name, "row", kind))
        else:
            parts.append((name, "shared"))
    return tuple(parts)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if is_tensor(a) or is_tensor(b):
        import torch

        return (
            is_tensor(a)
            and is_tensor(b)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and bool(torch.equal(a, b))
        )
    try:
        return bool(a == b)
    except Exception:  # values that cannot say: not shared
        return False


def _shared(call: _Call, name: str, joins: Mapping[str, ArgumentJoin]) -> bool:
    return name not in joins and not _per_row(call.kwargs[name], call.rows)


def _compatible(a: _Call, b: _Call, joins: Mapping[str, ArgumentJoin]) -> bool:
    if _signature(a, joins) != _signature(b, joins):
        return False
    return all(_same(value, b.kwargs[name]) for name, value in a.kwargs.items() if _shared(a, name, joins))


def _groups(calls: list[_Call], max_rows: int, joins: Mapping[str, ArgumentJoin]) -> list[list[_Call]]:
    """The calls in forwards: compatible ones together, at most ``max_rows`` rows (by weight) each (a
    call larger than that runs alone), in order of arrival."""
    groups: list[list[_Call]] = []
    for call in calls:
        for group in groups:
            if sum(c.weight for c in group) + call.weight <= max_rows and _compatible(group[0], call, joins):
                group.append(call)
                break
        else:
            groups.append([call])
    return groups


def _joined(group: list[_Call], joins: Mapping[str, ArgumentJoin]) -> dict[str, Any]:
    import torch

    first = group[0]
    joined: dict[str, Any] = {}
    for name, value in first.kwargs.items():
        values = [c.kwargs[name] for c in group]
        if name in joins:
            joined[name] = joins[name].join(values, [c.rows for c in group])
        elif not _per_row(value, first.rows):
            joined[name] = value
        elif is_tensor(value):
            joined[name] = torch.cat(values, dim=0)
        else:
            joined[name] = [item for v in values for item in v]
    return joined


def _split(out: Any, rows: list[int]) -> list[Any]:
    """A forward's output cut into the calls' rows, each part of the output's own type."""
    if is_tensor(out):
        return list(out.split(rows, dim=0))
    if isinstance(out, tuple | list):
        columns = [_split(item, rows) if is_tensor(item) else [item] * len(rows) for item in out]
        return [type(out)(column[i] for column in columns) for i in range(len(rows))]
    if hasattr(out, "to_tuple"):  # a diffusers BaseOutput (an ordered dict of tensors)
        fields = {key: _split(value, rows) for key, value in out.items()}
        return [type(out)(**{key: parts[i] for key, parts in fields.items()}) for i in range(len(rows))]
    raise TypeError(f"cannot split a denoiser output of type {type(out).__name__}")
