"""CFG-parallel denoising: a diffusion replica that spans ``cfg_parallel_size`` devices, one process each.

The replica's own process (rank 0) runs the engine and the pipelines as before; each other rank is a peer
process that holds only the denoiser, loaded from the same model directory onto its own device. Every
denoiser forward the pipelines make is cut into contiguous row ranges, one per rank: the peers' ranges go
out over a gloo process group, rank 0 computes its own meanwhile, and the outputs come back in row order.
With diffusers' batched guidance (``cat([negative, positive])``) the first half of a call's rows is its
unconditional branch and the second half its conditional one, so with two ranks each device computes one
guidance branch of every request at once: CFG parallelism. An unguided call's rows split the same way.

The transport is gloo on every device type, tensors staged through host memory (a step's latents and
text states: a few MiB for a 1024x1024 image), so the code that runs on a GPU host is the code tested on
CPU. What stays on rank 0 alone: a call whose rows cannot be taken apart (an argument joined per row by
step batching, such as GLM-Image's source-image cache), a call with a forward hook inside the denoiser
(LoRA adapters: the peers do not hold them), and every call once a peer has failed (logged once; the
replica then computes all rows itself, so no request is lost to it).

BAGEL's rows are (request, guidance branch) pairs, each attending to its own context's keys and values:
its rows argument is a :class:`SplittableJoin` (cut by row range like a tensor), and the rows' contexts
are :class:`PeerKept`: a peer receives its rows' context once and keeps it while the calls name it, so
each step sends only the latents (a batch's contexts are fixed across its steps; sent every step they
would be most of the traffic).

Sequence parallelism (``sequence_parallel_size``, ``sequence_parallel.py``) uses the same group the other
way round: every rank runs the whole forward on its share of the image tokens, and the ranks exchange at
each attention (Ulysses' all-to-all of heads, or an all-gather of the image keys and values).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import json
import logging
import pickle
import subprocess
import sys
import threading
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from vllm_omni_plugin.diffusion.step_batching import (
    UNUSED,
    ArgumentJoin,
    SameValue,
    by_name,
    is_tensor,
    rows_of,
    take_rows,
)

if TYPE_CHECKING:
    from vllm_omni_plugin.diffusion.sequence_parallel import SequencePlan

logger = logging.getLogger(__name__)

PEER_START_TIMEOUT_S = 600.0
"""How long rank 0 waits for its peers to load their denoisers and join the group."""
FORWARD_TIMEOUT_S = 600.0
"""The group's timeout for one exchange: a peer that neither answers nor dies within it has failed."""


@dataclass(frozen=True)
class PeerSpec:
    """What a peer process loads: the denoiser's class and where its weights are."""

    model: str
    subfolder: str
    module: str
    qualname: str
    dtype: str
    device: str
    num_threads: int | None
    trust_remote_code: bool = False


@runtime_checkable
class SplittableJoin(Protocol):
    """An :class:`ArgumentJoin` whose values can also be cut by rows (BAGEL's attention rows), so a call
    with one still splits over the group."""

    def take(self, value: Any, rows: range) -> Any:
        """``value`` for the rows ``rows`` of its call only."""


class PeerKept:
    """An argument a peer keeps between forwards: sent whole the first time a call names it, named by
    :attr:`wire_key` after that while consecutive calls to that peer keep naming it (a peer holds exactly
    the kept values of its last call)."""

    wire_key: Hashable
    """Equal for one value for as long as it lives (never reused by another)."""

    def wire_state(self) -> Any:
        """The value as the wire carries it: tensors in tuples, lists and dicts."""
        raise NotImplementedError

    @classmethod
    def from_wire(cls, state: Any, device: Any) -> PeerKept:
        """The value again, on the peer (``state``'s tensors are on ``device`` already)."""
        raise NotImplementedError


def split_rows(rows: int, ranks: int) -> list[range]:
    """Contiguous row ranges, one per rank, as even as they go (earlier ranks take the remainder)."""
    size, extra = divmod(rows, ranks)
    ranges, start = [], 0
    for rank in range(ranks):
        end = start + size + (1 if rank < extra else 0)
        ranges.append(range(start, end))
        start = end
    return ranges


class DenoiserGroup:
    """Rank 0's side: starts the peers, hands each its rows of a forward, and stops them."""

    def __init__(
        self, size: int, spec_of_rank: list[PeerSpec], *, timeout_s: float = FORWARD_TIMEOUT_S
    ) -> None:
        import torch.distributed as dist

        if size < 2 or len(spec_of_rank) != size - 1:
            raise ValueError(
                f"a denoiser group of {size} needs {size - 1} peer specs, got {len(spec_of_rank)}"
            )
        self.size = size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.failed: str | None = None
        """Why the peers are no longer used (None: they are)."""
        self._held: list[set[Hashable]] = [set() for _ in range(size)]
        """Per rank, the :class:`PeerKept` values it holds (those its last call named)."""
        self._lock = threading.Lock()
        self._store = dist.TCPStore(
            "127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=PEER_START_TIMEOUT_S),
            wait_for_workers=False,
        )  # fmt: skip
        # A fresh interpreter per peer (not multiprocessing's spawn, which re-imports the parent's main
        # module): its output goes where the replica's goes.
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    __name__,
                    json.dumps(asdict(spec)),
                    str(rank),
                    str(self._store.port),
                    str(size),
                ]  # fmt: skip
            )
            for rank, spec in enumerate(spec_of_rank, start=1)
        ]
        self._group = self._join()
        self._group.set_timeout(self.timeout)
        self._links = {rank: _Link(self._group, rank) for rank in range(1, size)}

    def _join(self) -> Any:
        """The group, once every peer has loaded its denoiser and joined; a peer that exits first (it
        could not load) stops the wait at once."""
        joined: list[Any] = []
        failed: list[BaseException] = []

        def connect() -> None:
            try:
                joined.append(
                    _gloo_group(self._store, 0, self.size, datetime.timedelta(seconds=PEER_START_TIMEOUT_S))
                )
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=connect, name="dit-cfg-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = [
                (rank, p.poll()) for rank, p in enumerate(self.processes, start=1) if p.poll() is not None
            ]
            if dead and thread.is_alive():
                self.failed = "start-up"
                self._stop_peers()
                codes = ", ".join(f"rank {rank} exited with code {code}" for rank, code in dead)
                raise RuntimeError(
                    f"the denoiser group's peers did not start: {codes} (the log above says why)"
                )
        if failed or not joined:
            self.failed = "start-up"
            self._stop_peers()
            raise RuntimeError(
                f"the denoiser group's peers did not join: {failed[0] if failed else 'no group'}"
            )
        return joined[0]

    def forward(
        self, module: Any, kwargs: dict[str, Any], ranges: list[range], joins: Mapping[str, ArgumentJoin]
    ) -> Any:
        """``module(**kwargs)`` with rank ``r`` computing the rows ``ranges[r]``; the outputs in row order."""
        rows = rows_of(kwargs)
        with self._lock:  # one exchange at a time: the group's messages are matched in order
            if self.failed is None:
                try:
                    busy = [rank for rank in range(1, self.size) if ranges[rank]]  # fewer rows than ranks
                    for rank in busy:
                        taken = _rows_taken(kwargs, ranges[rank], rows, joins)
                        self._links[rank].send(("rows", *self._kept(rank, taken)))
                    own = module(**_rows_taken(kwargs, ranges[0], rows, joins))
                    return _cat([own, *(self._reply(rank) for rank in busy)])
                except _PeerError as exc:
                    self._fail(str(exc))
                except RuntimeError as exc:  # gloo: a closed connection, a timeout
                    self._fail(f"the exchange with its peers failed: {exc}")
        return module(**kwargs)

    def forward_sequence(self, module: Any, kwargs: dict[str, Any], plan: SequencePlan) -> Any:
        """``module(**kwargs)`` with every rank computing its share of the image tokens (``plan``)."""
        from vllm_omni_plugin.diffusion.sequence_parallel import sequence_call

        with self._lock:
            if self.failed is None:
                try:
                    for rank in range(1, self.size):
                        self._links[rank].send(("sequence", kwargs, {}))
                    own = sequence_call(module, plan, kwargs, self._group, 0, self.size)
                    for rank in range(1, self.size):
                        self._reply(rank)
                    return own
                except _PeerError as exc:
                    self._fail(str(exc))
                except Exception as exc:  # gloo (a closed connection, a timeout), or this rank's forward
                    # The peers may wait inside a collective of the forward: they cannot be used again.
                    self._fail(f"a sequence-parallel forward failed: {type(exc).__name__}: {exc}")
            return module(**kwargs)

    def send_call(self, kwargs: dict[str, Any]) -> bool:
        """Hand rank 1 a whole call to compute; the group's other exchanges wait until :meth:`take_call`
        takes its output. False: not sent (the group has failed, or failed now; or an argument the wire
        cannot carry, found before anything is sent), and nothing to take."""
        self._lock.acquire()
        try:
            if self.failed is None:
                self._links[1].send(("rows", kwargs, {}))
                return True
        except RuntimeError as exc:  # gloo: a closed connection, a timeout
            self._fail(f"the exchange with its peers failed: {exc}")
        except Exception:  # pickling an argument
            pass
        self._lock.release()
        return False

    def take_call(self, device: Any = None) -> Any | None:
        """The output of the call :meth:`send_call` handed over (on ``device``); None if rank 1 failed."""
        try:
            return self._reply(1, device)
        except _PeerError as exc:
            self._fail(str(exc))
        except RuntimeError as exc:
            self._fail(f"the exchange with its peers failed: {exc}")
        finally:
            self._lock.release()
        return None

    def _reply(self, rank: int, device: Any = None) -> Any:
        """Rank ``rank``'s answer to the call it was sent (:class:`_PeerError` where its forward raised)."""
        reply = self._links[rank].take(device)
        if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "error":
            raise _PeerError(f"rank {rank}'s forward failed: {reply[1]}")
        return reply[1]

    def _kept(self, rank: int, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``kwargs`` without their :class:`PeerKept` values, and those as ``rank`` gets them: the key
        alone where it holds the value, else the key, the class and the value's state."""
        held, named = self._held[rank], set()
        plain: dict[str, Any] = {}
        kept: dict[str, Any] = {}
        for name, value in kwargs.items():
            if not isinstance(value, PeerKept):
                plain[name] = value
                continue
            key = value.wire_key
            named.add(key)
            kept[name] = (key,) if key in held else (key, type(value), value.wire_state())
        self._held[rank] = named
        return plain, kept

    def _fail(self, why: str) -> None:
        self.failed = why
        logger.error("denoiser group: %s; this replica computes every forward whole from now on", why)
        self._stop_peers()

    def _stop_peers(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)

    def close(self) -> None:
        """Stops the peers (a stop message, then a kill for any that did not leave)."""
        if self.failed is None and getattr(self, "_group", None) is not None:
            with contextlib.suppress(Exception), self._lock:
                for rank in range(1, self.size):
                    self._links[rank].send(None)
            for process in self.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
        self.failed = self.failed or "closed"
        self._stop_peers()

    @property
    def alive(self) -> bool:
        return self.failed is None and all(p.poll() is None for p in self.processes)


class DenoiserStandIn:
    """What stands in for a denoiser in a pipeline (its other attributes are the denoiser's): the calls
    go over a denoiser group."""

    def __init__(self, module: Any, group: DenoiserGroup) -> None:
        self._module = module
        self._group = group
        modules = getattr(module, "modules", None)  # BAGEL's velocity is no torch module
        self._inner = [m for m in modules() if m is not module] if modules is not None else []

    @functools.cached_property
    def _signature(self) -> inspect.Signature:
        return inspect.signature(self._module.forward)

    def _hooked(self) -> bool:
        """A hook inside the denoiser (a LoRA adapter's, a cache's): the peers hold neither."""
        from torch.nn.modules import module as nn_module

        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self._inner)

    @contextlib.contextmanager
    def cache_context(self, name: str) -> Iterator[None]:
        """diffusers' ``CacheMixin.cache_context`` (Qwen-Image's pipelines enter it around each branch)."""
        with self._module.cache_context(name):
            yield

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class RowParallelDenoiser(DenoiserStandIn):
    """The denoiser as the pipelines call it on a CFG-parallel replica: each forward's rows cut over the
    group's ranks (:class:`DenoiserGroup`), or computed here where they cannot be."""

    def __init__(
        self, module: Any, group: DenoiserGroup, joins: Mapping[str, ArgumentJoin] | None = None
    ) -> None:
        super().__init__(module, group)
        self._joins: Mapping[str, ArgumentJoin] = joins or {}
        self.split_calls = 0
        """Forwards whose rows went over the group (tests count them)."""

    def _splittable(self, kwargs: dict[str, Any]) -> bool:
        for name, join in self._joins.items():
            value = kwargs.get(name)
            if (
                value is not None
                and not isinstance(join, SameValue | SplittableJoin)
                and join.key(value) != UNUSED
            ):
                return False
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        named = by_name(self._signature, args, kwargs)
        rows = rows_of(named)
        group = self._group
        if rows < 2 or group.failed is not None or self._hooked() or not self._splittable(named):
            return self._module(**named)
        self.split_calls += 1
        return group.forward(self._module, named, split_rows(rows, group.size), self._joins)


class PairedBranches(DenoiserStandIn):
    """One pipeline call's denoiser on a CFG-parallel replica whose pipeline makes a guided step's two
    branches as two calls in turn (GLM-Image; Qwen-Image's true CFG), each of the request's rows alone:
    cutting rows cannot split them. The first step's pair shows which arguments differ between the
    branches (the prompt's embeddings, the dropped prior tokens, a cache the second branch skips) and
    which are the step's (the latents, the timestep). From then on, each step's first call sends the
    second call as it will be to rank 1 and computes the first here meanwhile; when the second call comes
    it takes rank 1's output, if the call is what was sent (else it computes it here: nothing is assumed).
    """

    def __init__(
        self,
        rows: RowParallelDenoiser,
        passes: Any,
        joins: Mapping[str, ArgumentJoin],
        latents: str = "hidden_states",
    ) -> None:
        super().__init__(rows._module, rows._group)
        self._rows = rows
        self._passes = passes
        """``passes(kwargs)``: a call that is no step (an edit's cache write): left alone."""
        self._joins = joins
        self._latents = latents
        self._first_pair: list[dict[str, Any]] = []
        self._shared: set[str] | None = None
        """Arguments both branches take as they are (None: not learnt yet)."""
        self._second: dict[str, Any] = {}
        """The second branch's own arguments (the first step's)."""
        self._sent: dict[str, Any] | None = None
        """The second call rank 1 computes (the group's lock is held until its output is taken)."""
        self.paired_calls = 0
        """Second calls whose output came from rank 1 (tests count them)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rows = self._rows
        named = by_name(self._signature, args, kwargs)
        if self._sent is not None:
            return self._take_second(named)
        if self._passes(named) or self._hooked() or self._group.failed is not None or self._shared == set():
            return rows(**named)
        own = self._own(named)
        if self._shared is None:  # the first step: learn what the branches share
            self._first_pair.append(own)
            if len(self._first_pair) == 2:
                self._learn(*self._first_pair)
            return rows(**named)
        second = {name: own[name] for name in self._shared} | self._second
        if not self._group.send_call(second):
            self._shared = set()  # not paired in this call from now on
            return rows(**named)
        self._sent = second
        try:
            return self._module(**named)
        except BaseException:
            self.close()
            raise

    def _own(self, named: dict[str, Any]) -> dict[str, Any]:
        """``named`` as a peer takes it: an argument the call leaves unused (a cache it skips) is None."""
        return {
            name: None
            if name in self._joins and value is not None and self._joins[name].key(value) == UNUSED
            else value
            for name, value in named.items()
        }

    def _learn(self, first: dict[str, Any], second: dict[str, Any]) -> None:
        shared = {name for name in first if name in second and _same(first[name], second[name])}
        if self._latents not in shared or set(second) - set(first):
            self._shared = set()  # not a pair of branches: no pairing in this call
            return
        self._shared = shared
        self._second = {name: value for name, value in second.items() if name not in shared}

    def _take_second(self, named: dict[str, Any]) -> Any:
        sent, self._sent = self._sent, None
        assert sent is not None
        output = self._group.take_call(named[self._latents].device)
        own = self._own(named)
        if output is not None and own.keys() == sent.keys() and all(_same(own[k], sent[k]) for k in own):
            self.paired_calls += 1
            return output
        return self._rows(**named)

    def close(self) -> None:
        """After the pipeline call: a second call that never came still has rank 1's output to take."""
        if self._sent is not None:
            self._sent = None
            self._group.take_call()


def _rows_taken(
    kwargs: dict[str, Any], keep: range, rows: int, joins: Mapping[str, ArgumentJoin]
) -> dict[str, Any]:
    """The call's arguments for the rows ``keep`` (a :class:`SplittableJoin`'s value cut by its join)."""
    taken = take_rows(kwargs, list(keep), rows, joins)
    for name, join in joins.items():
        if isinstance(join, SplittableJoin) and taken.get(name) is not None:
            taken[name] = join.take(taken[name], keep)
    return taken


def _same(a: Any, b: Any) -> bool:
    """The same argument: one object, or equal tensors (a timestep each call computes again)."""
    if a is b:
        return True
    if is_tensor(a) and is_tensor(b):
        import torch

        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
    if isinstance(a, (int, float, str, bool, type(None))) and type(a) is type(b):
        return a == b
    return False


# --- the wire ------------------------------------------------------------------------------------------


class _PeerError(Exception):
    """A peer's forward raised: its message, as the peer sent it."""


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of a message lies in its data: ``nbytes`` from ``offset``, then viewed as
    ``dtype`` in ``shape``."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: Any


ALIGN = 16
"""Each tensor's bytes start at a multiple of this (a view as a wider dtype needs its offset aligned)."""


def _strip(value: Any, tensors: list[Any], offset: list[int]) -> Any:
    """``value`` with its tensors replaced by slots (their host copies appended to ``tensors``)."""
    if is_tensor(value):
        import torch

        flat = value.detach().to("cpu").reshape(-1)
        if flat.stride() != (1,):  # an expanded tensor (a step's timestep for every row): stride 0
            flat = torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)
        raw = flat.view(torch.uint8)
        slot = _Slot(offset[0], raw.numel(), tuple(value.shape), value.dtype)
        pad = -raw.numel() % ALIGN
        tensors.append(raw if not pad else torch.cat([raw, raw.new_zeros(pad)]))
        offset[0] += raw.numel() + pad
        return slot
    if type(value) is dict:
        return {k: _strip(v, tensors, offset) for k, v in value.items()}
    if type(value) in (tuple, list):
        return type(value)(_strip(v, tensors, offset) for v in value)
    if hasattr(value, "to_tuple"):  # a diffusers BaseOutput
        return (type(value), {k: _strip(v, tensors, offset) for k, v in value.items()})
    return value


def _fill(value: Any, data: Any, device: Any) -> Any:
    if isinstance(value, _Slot):
        tensor = data[value.offset : value.offset + value.nbytes].view(value.dtype).reshape(value.shape)
        return tensor if device is None else tensor.to(device)
    if isinstance(value, dict):
        return {k: _fill(v, data, device) for k, v in value.items()}
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], type)
        and hasattr(value[0], "to_tuple")
    ):
        return value[0](**_fill(value[1], data, device))
    if isinstance(value, tuple | list):
        return type(value)(_fill(v, data, device) for v in value)
    return value


FIRST_PART = 64 * 1024
"""The least size of a message's first part, which is sent whole (padded): the receiver has its receive
posted before the sender sends it: gloo takes a slow path (an extra round trip) for a message that arrives
before its receive is posted."""
LARGEST_FIRST_PART = 8 * 1024 * 1024
"""The most a first part grows to (a longer message follows its first part whole, in a second send)."""


def _first_part(length: int) -> int:
    """The size of the first part after a message of ``length`` bytes, on both ends of a link: a quarter
    over it, in whole :data:`FIRST_PART` units (a step's messages keep their size; the next fits whole)."""
    wanted = length + length // 4 + ALIGN
    return min(LARGEST_FIRST_PART, max(FIRST_PART, -(-wanted // FIRST_PART) * FIRST_PART))


class _Link:
    """The messages between this rank and one other, in order each way. A message is its header (the
    structure, tensors as slots) and its tensors' bytes in one buffer, within a first part after its length
    where it fits, else after that part; the receive of the next first part is always posted, its size
    following the last message's the same way on both ends (:func:`_first_part`), so that a step's
    message, whatever its size, is one gloo send into a waiting receive."""

    def __init__(self, group: Any, rank: int) -> None:
        self._group = group
        self._rank = rank
        self._sending = FIRST_PART
        self._receiving = FIRST_PART
        self._post()

    def send(self, value: Any) -> None:
        import torch

        tensors: list[Any] = []
        header = pickle.dumps(_strip(value, tensors, [0]))
        start = 8 + len(header)
        pad = -start % ALIGN
        prefix = torch.frombuffer(
            bytearray(len(header).to_bytes(8, "little") + header + bytes(pad)), dtype=torch.uint8
        )
        message = torch.cat([prefix, *tensors]) if tensors else prefix
        length = message.numel()
        inline = length <= self._sending - ALIGN
        first = torch.zeros(self._sending, dtype=torch.uint8)
        first[:ALIGN] = torch.frombuffer(bytearray(length.to_bytes(ALIGN, "little")), dtype=torch.uint8)
        if inline:
            first[ALIGN : ALIGN + length] = message
        self._sending = _first_part(length)
        _wait(self._group.send([first], self._rank, 0))
        if not inline:
            _wait(self._group.send([message], self._rank, 0))

    def _post(self) -> None:
        import torch

        self._first = torch.empty(self._receiving, dtype=torch.uint8)
        self._work = self._group.recv([self._first], self._rank, 0)

    def take(self, device: Any = None) -> Any:
        """The next message (its tensors on ``device``; views of the received bytes where None)."""
        import torch

        _wait(self._work)
        first = self._first
        length = int.from_bytes(first[:8].numpy().tobytes(), "little")
        if length <= first.numel() - ALIGN:
            message = first[ALIGN : ALIGN + length]
        else:
            message = torch.empty(length, dtype=torch.uint8)
            _wait(self._group.recv([message], self._rank, 0))
        self._receiving = _first_part(length)
        self._post()  # a new buffer: the tensors of this message stay views of the old one
        size = int.from_bytes(message[:8].numpy().tobytes(), "little")
        structure = pickle.loads(message[8 : 8 + size].numpy().tobytes())
        start = 8 + size
        return _fill(structure, message[start + (-start % ALIGN) :], device)


def _wait(work: Any) -> None:
    work.wait()


def _cat(parts: list[Any]) -> Any:
    """The outputs of consecutive row ranges as one output over all rows (the inverse of a split)."""
    import torch

    first = parts[0]
    if is_tensor(first):
        return torch.cat([p.to(first.device) for p in parts], dim=0)
    if isinstance(first, tuple | list):
        return type(first)(
            _cat([p[i] for p in parts]) if is_tensor(item) else item for i, item in enumerate(first)
        )
    if hasattr(first, "to_tuple"):
        return type(first)(**{key: _cat([p[key] for p in parts]) for key in first.keys()})
    raise TypeError(f"cannot join denoiser outputs of type {type(first).__name__}")


def _gloo_group(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, size, timeout)


# --- a peer --------------------------------------------------------------------------------------------


def _exit_with_parent() -> None:
    """A peer outlives no rank 0: a SIGKILLed replica leaves no peer holding a device."""
    import os
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="dit-cfg-parent", daemon=True).start()


def _peer_main(spec: PeerSpec, rank: int, port: int, size: int) -> None:
    """A peer process: load the denoiser, join the group, answer forwards until told to stop."""
    import importlib
    import os

    import torch
    import torch.distributed as dist

    _exit_with_parent()
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    cls = importlib.import_module(spec.module)
    for part in spec.qualname.split("."):
        cls = getattr(cls, part)
    dtype = getattr(torch, spec.dtype.removeprefix("torch."))
    device = torch.device(spec.device)
    if hasattr(cls, "load_peer"):  # a denoiser of ours (BAGEL's velocity), not a diffusers model
        module = cls.load_peer(spec.model, dtype=dtype, device=device)
    else:
        module = cls.from_pretrained(spec.model, subfolder=spec.subfolder, torch_dtype=dtype)
        module = module.to(device).eval()
    store = dist.TCPStore(
        "127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=PEER_START_TIMEOUT_S)
    )
    group = _gloo_group(store, rank, size, datetime.timedelta(seconds=PEER_START_TIMEOUT_S))
    group.set_timeout(datetime.timedelta(days=365))  # idle between requests for as long as the replica is
    from vllm_omni_plugin.diffusion.sequence_parallel import sequence_call, sequence_plan

    link = _Link(group, 0)
    plan: SequencePlan | None = None
    held: dict[Hashable, PeerKept] = {}
    """The kept values the last call named (:class:`PeerKept`)."""
    while True:
        try:
            message = link.take(device)
        except RuntimeError:  # rank 0 is gone
            return
        if message is None:
            return
        mode, kwargs, kept = message
        try:
            now = {}
            for name, (key, *sent) in kept.items():
                now[key] = held[key] if not sent else sent[0].from_wire(sent[1], device)
                kwargs[name] = now[key]
            held = now
            with torch.no_grad():
                if mode == "sequence":
                    plan = plan or sequence_plan(module)
                    sequence_call(module, plan, kwargs, group, rank, size)
                    reply: tuple[str, Any] = ("ok", None)
                else:
                    reply = ("ok", module(**kwargs))
        except Exception as exc:
            if mode == "sequence":
                # Rank 0 may wait in a collective this rank will not reach: leaving closes the group's
                # connections, which ends that wait with an error, and rank 0 goes on alone.
                logger.error("sequence-parallel rank %d: %s: %s; leaving", rank, type(exc).__name__, exc)
                os._exit(1)
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            link.send(reply)
        except RuntimeError:
            return


if __name__ == "__main__":
    # Run as ``python -m``: this file is ``__main__`` here, so the peer runs the package module's copy,
    # whose classes are the ones rank 0's pickles name.
    from vllm_omni_plugin.diffusion import peer_group

    spec = peer_group.PeerSpec(**json.loads(sys.argv[1]))
    peer_group._peer_main(spec, int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
