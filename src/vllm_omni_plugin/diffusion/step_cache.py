"""Step caching: a request skips its denoiser's forward at some steps and takes an estimate of its output
from the steps it computed (FORA's and TeaCache's idea at the granularity of the whole forward, with
TaylorSeer's first-order extrapolation).

Decisions are per request, never per batch: a step's forward runs for the rows of the requests that
compute it and leaves out those that take their cache, so requests with and without caching (or with
different settings) share batches, each getting the image it gets alone. Where a call's rows cannot be
taken apart (an argument joined per row, a row's LoRA adapter, a step-batched group), every row runs
and the cached requests still take their estimates.

Why not cache-dit's DBCache: it keeps one cache per transformer module and decides per forward, for the
whole batch, while the stage runs several pipeline calls at once on one transformer (step batching) and
batches of requests with their own settings; its first blocks always run (``Fn_compute_blocks``), which
on a small model is most of the forward; and BAGEL's DiT is not a diffusers transformer.

Policies (the stage's ``cache`` block; a request's ``cache`` field overrides it field by field):

- ``fixed``: after ``warmup_steps`` computed steps, one step in ``compute_every`` is computed, and the
  last ``final_steps`` are computed too. Deterministic: a test counts the block evaluations it saves.
- ``threshold``: a step is computed once the relative L1 change of the request's denoiser input
  (its latents), summed over the steps since it last computed, reaches ``threshold``, or after
  ``max_cached_steps`` cached steps in a row (TeaCache's rule, on the input rather than a model's
  modulated input, so that it serves every runner).

A cached step's output is the last computed one (``extrapolate: false``), or the line through the last
two, by timestep (``extrapolate: true``, the default).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from vllm_omni_plugin.diffusion.step_batching import (
    UNUSED,
    ArgumentJoin,
    SameValue,
    by_name,
    expand_rows,
    is_tensor,
    live_rows,
    rows_of,
    take_rows,
)
from vllm_omni_plugin.diffusion.step_loop import Forward, LoopLayer

CachePolicy = Literal["none", "fixed", "threshold"]


class StepCacheSpec(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """Step caching settings: a stage's ``cache`` block, a request's ``cache`` override (fields it sets
    win), and, resolved (:meth:`resolved`), what a request runs with. Unset fields take the defaults."""

    policy: CachePolicy | None = None
    """``none`` (default: every step computed), ``fixed`` or ``threshold``."""
    compute_every: Annotated[int, Meta(ge=1)] | None = None
    """``fixed``: of the steps between warm-up and the final ones, one in this many is computed (2: half)."""
    threshold: Annotated[float, Meta(gt=0.0)] | None = None
    """``threshold``: the summed relative change of the input that makes a step computed (0.1)."""
    max_cached_steps: Annotated[int, Meta(ge=1)] | None = None
    """``threshold``: at most this many cached steps in a row (3)."""
    warmup_steps: Annotated[int, Meta(ge=1)] | None = None
    """The first steps, always computed (2)."""
    final_steps: Annotated[int, Meta(ge=0)] | None = None
    """The last steps, always computed (1)."""
    extrapolate: bool | None = None
    """A cached step extrapolates from the last two computed outputs by timestep (default), rather than
    reusing the last one."""

    def over(self, base: StepCacheSpec | None) -> StepCacheSpec:
        """These settings over ``base`` (fields set here win)."""
        if base is None:
            return self
        return msgspec.structs.replace(
            base, **{f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not None}
        )

    def resolved(self) -> StepCacheSpec:
        """Every field set (the defaults where unset)."""
        return self.over(DEFAULT_CACHE)

    @property
    def active(self) -> bool:
        return self.policy not in (None, "none")

    def describe(self) -> str:
        s = self.resolved()
        if s.policy == "fixed":
            rule = f"one step in {s.compute_every}"
        elif s.policy == "threshold":
            rule = f"threshold {s.threshold:g}, at most {s.max_cached_steps} cached in a row"
        else:
            return "off"
        return (
            f"{s.policy}: {rule}, first {s.warmup_steps} and last {s.final_steps} steps computed, "
            f"{'extrapolated' if s.extrapolate else 'reused'} outputs"
        )


DEFAULT_CACHE = StepCacheSpec(
    policy="none",
    compute_every=2,
    threshold=0.1,
    max_cached_steps=3,
    warmup_steps=2,
    final_steps=1,
    extrapolate=True,
)


def fixed_plan(spec: StepCacheSpec, steps: int) -> list[bool]:
    """Which of ``steps`` steps the ``fixed`` policy computes (True: computed)."""
    s = spec.resolved()
    assert s.compute_every is not None and s.warmup_steps is not None and s.final_steps is not None
    return [
        step < s.warmup_steps
        or step >= steps - s.final_steps
        or (step - s.warmup_steps) % s.compute_every == 0
        for step in range(steps)
    ]


class _RequestCache:
    """One request's decisions and its last computed outputs, per call slot of a step."""

    def __init__(self, spec: StepCacheSpec | None, steps: int) -> None:
        self.spec = spec.resolved() if spec is not None and spec.active else None
        self.plan = (
            fixed_plan(self.spec, steps) if self.spec is not None and self.spec.policy == "fixed" else None
        )
        self.steps = steps
        self.outputs: dict[int, list[tuple[float, Any]]] = {}
        """Slot -> the last two computed outputs (coordinate, rows), oldest first."""
        self.last_input: Any = None
        self.change = 0.0
        self.cached_in_row = 0

    def decide(self, step: int, row_input: Any) -> bool:
        """Whether it computes ``step`` (its input's first row: ``row_input``, for ``threshold``)."""
        spec = self.spec
        if spec is None:
            return True
        assert spec.warmup_steps is not None and spec.final_steps is not None
        forced = step < spec.warmup_steps or step >= self.steps - spec.final_steps or not self.outputs
        if self.plan is not None:
            compute = forced or (step < len(self.plan) and self.plan[step])
        else:
            assert spec.threshold is not None and spec.max_cached_steps is not None
            if self.last_input is not None and row_input is not None:
                previous = self.last_input
                scale = float(previous.abs().mean()) or 1.0
                self.change += float((row_input.float() - previous).abs().mean()) / scale
            compute = forced or self.change >= spec.threshold or self.cached_in_row >= spec.max_cached_steps
        if row_input is not None and self.plan is None:
            self.last_input = row_input.detach().float().clone()
        if compute:
            self.change, self.cached_in_row = 0.0, 0
        else:
            self.cached_in_row += 1
        return compute

    def store(self, slot: int, coordinate: float, rows: Any) -> None:
        if self.spec is None:
            return
        kept = self.outputs.setdefault(slot, [])
        kept.append((coordinate, rows))
        del kept[:-2]

    def estimate(self, slot: int, coordinate: float) -> Any:
        """Its output at ``coordinate`` from the computed ones of this slot."""
        kept = self.outputs[slot]
        (c1, last) = kept[-1]
        if len(kept) < 2 or not (self.spec is not None and self.spec.extrapolate):
            return last
        (c0, before) = kept[0]
        if c1 == c0:
            return last
        slope = (coordinate - c1) / (c1 - c0)
        return (last.float() + (last.float() - before.float()) * slope).to(last.dtype)


class CacheCounts:
    """Block evaluations a stage's requests computed and took from their caches (``/metrics``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.computed = 0
        self.cached = 0

    def add(self, computed: int, cached: int) -> None:
        with self._lock:
            self.computed += computed
            self.cached += cached


class CallCache:
    """The step caches of one pipeline call's requests: which compute each step, and their outputs.

    ``specs``: each request's resolved settings (None: caching off for it), ``steps`` its step count,
    ``blocks`` the denoiser's repeated blocks (each request's computed or cached step counts that many
    block evaluations, reported to ``on_counts(computed, cached)``)."""

    def __init__(
        self,
        specs: list[StepCacheSpec | None],
        steps: int | Callable[[], int],
        blocks: int,
        on_counts: Callable[[int, int], None] | None = None,
    ) -> None:
        self._specs = specs
        self._steps = steps
        self.requests: list[_RequestCache] = []
        self.blocks = max(1, blocks)
        self.on_counts = on_counts
        self.step = 0
        self.slot = 0
        self.compute: list[bool] = [True] * len(specs)
        self.size = len(specs)

    @staticmethod
    def wanted(specs: list[StepCacheSpec | None]) -> bool:
        return any(spec is not None and spec.active for spec in specs)

    def begin(self, inputs: Any) -> list[bool]:
        """The step's decisions, taken at its first call (``inputs``: a tensor whose row ``r`` is request
        ``r``'s input, or None)."""
        if not self.requests:  # the call's step count is known once it runs (image-to-image's strength)
            steps = self._steps() if callable(self._steps) else self._steps
            self.requests = [_RequestCache(spec, steps) for spec in self._specs]
        self.compute = [
            cache.decide(self.step, None if inputs is None else inputs[r])
            for r, cache in enumerate(self.requests)
        ]
        return self.compute

    def step_done(self) -> None:
        self.step += 1
        self.slot = 0

    def velocities(self, computed: Any, compute: list[bool], coordinate: float) -> Any:
        """A step's outputs, one row per request: ``computed``'s rows for the requests that compute it
        (stored for later steps), estimates for the others (``computed`` None: none computed)."""
        import torch

        rows = []
        for r, request in enumerate(self.requests):
            if compute[r]:
                request.store(0, coordinate, computed[r])
                rows.append(computed[r])
            else:
                rows.append(request.estimate(0, coordinate))
        return torch.stack(rows)

    def count(self, ran: list[bool]) -> None:
        """A call ran the rows of the requests ``ran`` and skipped the others'."""
        if self.on_counts is not None:
            computed = sum(ran)
            self.on_counts(computed * self.blocks, (len(ran) - computed) * self.blocks)


class CachedDenoiser:
    """A diffusers pipeline's denoiser as one call's requests see it with step caching: each call runs the
    rows of the requests that compute this step (all of them where the rows cannot be taken apart:
    ``takes_rows`` false, or :func:`live_rows` declines) and gives the others their estimates. Request
    ``r``'s rows are those ``i`` with ``i % requests == r`` (one row each, or diffusers' guidance pair).
    Calls ``passes(kwargs)`` names (GLM-Image's write of its source images) run as they are."""

    def __init__(
        self,
        inner: Any,
        cache: CallCache,
        *,
        module: Any,
        joins: Mapping[str, ArgumentJoin],
        takes_rows: bool,
        passes: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        self._inner = inner
        self._cache = cache
        self._module = module
        self._joins = joins
        self._takes_rows = takes_rows
        self._passes = passes
        self._templates: dict[int, Any] = {}

    @functools.cached_property
    def _signature(self) -> inspect.Signature:
        return inspect.signature(self._module.forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        named = by_name(self._signature, args, kwargs)
        if self._passes is not None and self._passes(named):
            return self._inner(**named)
        cache = self._cache
        requests = cache.size
        rows = rows_of(named)
        if rows % requests:
            cache.count([True] * requests)
            return self._inner(**named)
        slot = cache.slot
        cache.slot += 1
        states = named.get("hidden_states")
        if slot == 0 or not cache.requests:
            cache.begin(states if is_tensor(states) and states.shape[0] >= requests else None)
        # a request without an output of this slot yet computes it whatever its decision
        compute = [
            c or not request.outputs.get(slot)
            for c, request in zip(cache.compute, cache.requests, strict=True)
        ]
        coordinate = _coordinate(named.get("timestep"), cache.step)
        ran = list(compute)
        if all(compute):
            out = self._inner(**named)
        elif not any(compute) and slot in self._templates:
            out = None
        else:
            keep = live_rows(named, requests, compute, self._joins) if self._takes_rows else None
            if keep is None:
                out = self._inner(**named)
                ran = [True] * requests
            else:
                out = expand_rows(self._inner(**take_rows(named, keep, rows, self._joins)), keep, rows)
        cache.count(ran)
        if out is not None:
            self._templates[slot] = out
            primary = _primary(out)
        else:
            primary = None
        for r, request in enumerate(cache.requests):
            mine = list(range(r, rows, requests))
            if compute[r]:
                if primary is not None:
                    request.store(slot, coordinate, primary[mine])
                continue
            estimate = request.estimate(slot, coordinate)
            if primary is None:
                primary = _primary(self._templates[slot]).new_empty((rows, *estimate.shape[1:]))
            primary[mine] = estimate
        return _with_primary(self._templates[slot], primary)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _CachingLayer(LoopLayer):
    """What the step loop's caching layers share: each caching request's cache, made as it is admitted
    (``steps``: its state's step count), and where the block evaluations computed and taken from caches
    go (``on_counts``, read when counted)."""

    field = "cache"

    def __init__(
        self,
        steps: Callable[[Any], int],
        blocks: int,
        on_counts: Callable[[], Callable[[int, int], None] | None],
    ) -> None:
        self.steps = steps
        self.blocks = max(1, blocks)
        self.on_counts = on_counts
        self.caches: dict[Any, _RequestCache] = {}

    def serves(self, request: Any) -> bool:
        return request.cache is not None and request.cache.active

    def admit(self, request: Any, state: Any) -> None:
        if self.serves(request):
            self.caches[state] = _RequestCache(request.cache, self.steps(state))

    def leave(self, state: Any) -> None:
        self.caches.pop(state, None)


class StepCacheLayer(_CachingLayer):
    """Step caching in the step loop: at its first forward of a step each caching request decides, as in a
    whole call, whether it computes (on its state's ``latents``); the forward runs the rows of the
    requests that compute (all of them where none is left out) and gives the others the estimates of
    their outputs, per forward of the step (slot) and by the forward's ``timestep`` input (else the
    state's own), exactly as :class:`CachedDenoiser` does for a call's rows. Requests without caching
    beside them always compute. Forwards ``passes`` names (GLM-Image's write of its source images) run as
    they are; a forward that reads an argument joined per row (an edit's source-image K/V) runs every row,
    the cached requests still taking their estimates."""

    def __init__(
        self,
        steps: Callable[[Any], int],
        joins: Mapping[str, ArgumentJoin],
        blocks: int,
        on_counts: Callable[[], Callable[[int, int], None] | None],
        passes: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        super().__init__(steps, blocks, on_counts)
        self.joins = joins
        self.passes = passes
        self.slots: dict[Any, tuple[int, int, bool]] = {}
        """Per caching state: the step it decided at, its next forward slot in that step, the decision."""

    def leave(self, state: Any) -> None:
        super().leave(state)
        self.slots.pop(state, None)

    def wrap(self, call: Forward) -> Forward:
        def cached(owners: list[Any], inputs: dict[str, Any]) -> Any:
            passes = self.passes is not None and self.passes(inputs)
            if passes or not any(owner in self.caches for owner in owners):
                return call(owners, inputs)
            return self._forward(call, owners, inputs)

        return cached

    def _forward(self, call: Forward, owners: list[Any], inputs: dict[str, Any]) -> Any:
        timestep = inputs.get("timestep")
        rows_of_owner: dict[Any, list[int]] = {}
        for row, owner in enumerate(owners):
            rows_of_owner.setdefault(owner, []).append(row)
        computes: dict[Any, bool] = {}
        slot_of: dict[Any, int] = {}
        for owner in rows_of_owner:
            cache = self.caches.get(owner)
            if cache is None:
                computes[owner] = True
                continue
            step, slot, decided = self.slots.get(owner, (-1, 0, True))
            if step != owner.index:  # its first forward of this step
                decided = cache.decide(owner.index, owner.latents[0])
                step, slot = owner.index, 0
            self.slots[owner] = (step, slot + 1, decided)
            slot_of[owner] = slot
            # one without an output of this slot yet computes it whatever its decision
            computes[owner] = decided or not cache.outputs.get(slot)
        keep = [row for row, owner in enumerate(owners) if computes[owner]]
        separable = all(
            isinstance(join, SameValue) or inputs.get(name) is None or join.key(inputs[name]) == UNUSED
            for name, join in self.joins.items()
        )
        out = None
        if len(keep) == len(owners) or (keep and not separable):
            out = call(owners, inputs)
        elif keep:
            part = call([owners[row] for row in keep], take_rows(inputs, keep, len(owners), self.joins))
            out = part.new_empty((len(owners), *part.shape[1:]))
            out[keep] = part
        for owner, slot in slot_of.items():
            cache, rows = self.caches[owner], rows_of_owner[owner]
            at = timestep[rows[0]] if is_tensor(timestep) else float(owner.timesteps[owner.index])
            coordinate = _coordinate(at, owner.index)
            if computes[owner]:
                cache.store(slot, coordinate, out[rows])
                continue
            estimate = cache.estimate(slot, coordinate)
            if out is None:
                out = estimate.new_empty((len(owners), *estimate.shape[1:]))
            out[rows] = estimate
        counted = self.on_counts()
        if counted is not None:
            computed = sum(computes.values())
            counted(computed * self.blocks, (len(computes) - computed) * self.blocks)
        return out


class GuidedStepCacheLayer(_CachingLayer):
    """Step caching in the step loop for a family whose whole call caches each step's guided output
    (BAGEL's velocity, :class:`CallCache`'s one slot): at each step a caching request decides on its
    latents, as in the whole call, whether it computes; one that does not is answered with the estimate
    of its guided output at the step's timestep (:meth:`answer`), its rows left out of the forward, and
    one that does keeps the guided output it stepped with."""

    def __init__(
        self,
        steps: Callable[[Any], int],
        blocks: int,
        on_counts: Callable[[], Callable[[int, int], None] | None],
    ) -> None:
        super().__init__(steps, blocks, on_counts)
        self.computing: set[Any] = set()
        """The caching states whose step the forward computes."""

    def leave(self, state: Any) -> None:
        super().leave(state)
        self.computing.discard(state)

    def answer(self, state: Any) -> Any | None:
        cache = self.caches.get(state)
        if cache is None:
            return None
        computes = cache.decide(state.index, state.latents[0])
        counted = self.on_counts()
        if counted is not None:
            counted(self.blocks if computes else 0, 0 if computes else self.blocks)
        if computes:
            self.computing.add(state)
            return None
        return cache.estimate(0, float(state.timesteps[state.index]))[None]

    def stepped(self, state: Any, sample: Any, output: Any) -> None:
        if state in self.computing:
            self.computing.discard(state)
            self.caches[state].store(0, float(state.timesteps[state.index]), output[0])


def _coordinate(timestep: Any, step: int) -> float:
    """Where a step lies for extrapolation: its timestep (any scale: the line is the same), else its
    index."""
    if is_tensor(timestep) and timestep.numel() > 0:
        return float(timestep.flatten()[0])
    if isinstance(timestep, int | float):
        return float(timestep)
    return float(step)


def _primary(out: Any) -> Any:
    """A denoiser output's prediction tensor (a tensor, a tuple's first item, a diffusers output's first
    field)."""
    if is_tensor(out):
        return out
    if isinstance(out, tuple | list):
        return out[0]
    if hasattr(out, "to_tuple"):
        return out.to_tuple()[0]
    raise TypeError(f"cannot cache a denoiser output of type {type(out).__name__}")


def _with_primary(template: Any, tensor: Any) -> Any:
    """``template``'s structure with ``tensor`` as its prediction."""
    if is_tensor(template):
        return tensor
    if isinstance(template, tuple | list):
        return type(template)([tensor, *template[1:]])
    keys = list(template.keys())
    return type(template)(**{key: tensor if i == 0 else template[key] for i, key in enumerate(keys)})
