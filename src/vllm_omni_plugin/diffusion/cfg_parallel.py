"""CFG-parallel denoising (``cfg_parallel_size``): every denoiser forward the pipelines make is cut into
contiguous row ranges, one per rank of the replica's denoiser group (``peer_group.py``): the peers' ranges
go out to them, rank 0 computes its own meanwhile, and the outputs come back in row order. With diffusers'
batched guidance (``cat([negative, positive])``) the first half of a call's rows is its unconditional
branch and the second half its conditional one, so with two ranks each device computes one guidance
branch of every request at once: CFG parallelism. An unguided call's rows split the same way.

What stays on rank 0 alone: a call whose rows cannot be taken apart (an argument joined per row by step
batching, such as GLM-Image's source-image cache), a call with a forward hook inside the denoiser (LoRA
adapters: the peers do not hold them), and every call once a peer has failed.

BAGEL's rows are (request, guidance branch) pairs, each attending to its own context's keys and values:
its rows argument is a :class:`SplittableJoin` (cut by row range like a tensor), and the rows' contexts
are ``PeerKept`` values a peer keeps for the batch (``peer_group.py``).

A pipeline that makes a guided step's two branches as two calls in turn (GLM-Image; Qwen-Image's true
CFG) gets :class:`PairedBranches`: rank 1 computes each step's second call while rank 0 computes the first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from vllm_omni_plugin.diffusion.peer_group import DenoiserGroup, DenoiserStandIn
from vllm_omni_plugin.diffusion.step_batching import (
    UNUSED,
    ArgumentJoin,
    SameValue,
    by_name,
    is_tensor,
    rows_of,
    take_rows,
    without_unused,
)
from vllm_omni_plugin.diffusion.step_loop import LoopLayer


@runtime_checkable
class SplittableJoin(Protocol):
    """An :class:`ArgumentJoin` whose values can also be cut by rows (BAGEL's attention rows), so a call
    with one still splits over the group."""

    def take(self, value: Any, rows: range) -> Any:
        """``value`` for the rows ``rows`` of its call only."""


def split_rows(rows: int, ranks: int) -> list[range]:
    """Contiguous row ranges, one per rank, as even as they go (earlier ranks take the remainder)."""
    size, extra = divmod(rows, ranks)
    ranges, start = [], 0
    for rank in range(ranks):
        end = start + size + (1 if rank < extra else 0)
        ranges.append(range(start, end))
        start = end
    return ranges


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
        return self._split(named, rows, split_rows(rows, group.size))

    def _split(self, named: dict[str, Any], rows: int, ranges: list[range]) -> Any:
        """``module(**named)`` with rank ``r`` computing the rows ``ranges[r]`` (a rank with none gets no
        call: fewer rows than ranks); the outputs in row order."""
        joins = self._joins
        calls = {
            rank: without_unused(_rows_taken(named, ranges[rank], rows, joins), joins)
            for rank in range(1, len(ranges))
            if ranges[rank]
        }
        done = self._group.exchange(
            "rows", calls, lambda: self._module(**_rows_taken(named, ranges[0], rows, joins))
        )
        if done is None:
            return self._module(**named)
        own, outputs = done
        return _cat([own, *outputs])


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
        return without_unused(named, self._joins)

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


class ParallelDenoiserLayer(LoopLayer):
    """CFG or sequence parallelism as a layer of the step loop (``diffusion/step_loop.py``): the family's
    forwards, over the rows of every request in the step, call the replica's stand-in
    (:class:`RowParallelDenoiser` or ``sequence_parallel.SequenceParallelDenoiser``), which computes
    them over its group. A forward of one row (an unguided request alone; each of Qwen-Image's true-CFG
    forwards for one request) stays on rank 0, as the stand-in keeps it."""

    def __init__(self, stand_in: Callable[[], DenoiserStandIn | None]) -> None:
        self._stand_in = stand_in
        """The replica's stand-in (None: this stage is no parallel replica); asked at each forward, as the
        engine starts the group after the family's layers are built."""

    def denoiser(self, module: Any) -> Any:
        stand_in = self._stand_in()
        return module if stand_in is None else stand_in


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
