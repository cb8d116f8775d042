"""Parking preempted step-loop states in host memory while the stage's memory budget needs their room.

A request preempted between steps (``diffusion/step_loop.py``) keeps its denoising state: its latents,
scheduler copy, conditioning (prompt embeddings; BAGEL's context K/V, the largest). On an accelerator those
stay in device memory beside the better requests' activations unless they are parked: every tensor the
state reaches is moved to host memory (pinned, copied on the stream the loop runs on) and moved back before
the state's next step. The copy is exact, so a parked request's image is the one it would have got.

What is moved is found by walking the state's fields (dataclasses, plain objects, msgspec structs,
containers), never entering modules or generators. Objects below the state are copied, not changed, where a
tensor in them moves, so what the state shares with others (a cached negative prompt's embeddings, a
context another request shares) stays where it is for them; tensors that a resident state also reaches are
left on the device, as moving them frees nothing. Each distinct storage moves once and every tensor is
rebuilt as the same view of its moved storage, so views keep sharing their storage. What a loop layer
keeps for a state outside it (a step cache's last outputs) stays where it is.

On a CPU stage the host is the device, so nothing is parked there (the engine builds no parking); the
same moves between two CPU storages are what the tests run.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

MAX_DEPTH = 8
"""How deep a state's objects are walked (a state is a few levels: state -> scheduler or bank -> tensor)."""

_LEAVES = (
    torch.nn.Module,
    torch.Generator,
    type,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    str,
    bytes,
    int,
    float,
    bool,
    complex,
    type(None),
)
"""What the walk never enters: weights are not a state's, a generator's state lives where it was made."""


def _children(obj: Any) -> dict[str, Any] | None:
    """An object's fields by name (None: a leaf or a container)."""
    if isinstance(obj, msgspec.Struct):
        return {name: getattr(obj, name) for name in obj.__struct_fields__}
    fields = getattr(obj, "__dict__", None)
    return dict(fields) if isinstance(fields, dict) else None


def _rebuilt(obj: Any, move: Callable[[torch.Tensor], torch.Tensor], memo: dict[int, Any], depth: int) -> Any:
    """``obj`` with every tensor it reaches replaced by ``move(tensor)``: ``obj`` itself where nothing in it
    moved, else a copy (a container of the same type, a shallow copy of an object)."""
    key = id(obj)
    if key in memo:
        return memo[key]
    memo[key] = obj  # a cycle back to ``obj`` keeps it
    if isinstance(obj, torch.Tensor):
        out = move(obj)
    elif isinstance(obj, _LEAVES) or depth >= MAX_DEPTH:
        out = obj
    elif isinstance(obj, (list, tuple)):
        items = [_rebuilt(item, move, memo, depth + 1) for item in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            out = obj
        elif isinstance(obj, list):
            out = items
        else:
            out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    elif isinstance(obj, dict):
        values = {k: _rebuilt(v, move, memo, depth + 1) for k, v in obj.items()}
        out = obj if all(values[k] is v for k, v in obj.items()) else type(obj)(values)
    else:
        fields = _children(obj)
        if fields is None:
            out = obj
        else:
            changed = {
                k: new for k, v in fields.items() if (new := _rebuilt(v, move, memo, depth + 1)) is not v
            }
            if not changed:
                out = obj
            elif isinstance(obj, msgspec.Struct):
                out = msgspec.structs.replace(obj, **changed)
            else:
                out = copy.copy(obj)
                out.__dict__.update(changed)
    memo[key] = out
    return out


def state_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor the state reaches."""
    found: list[torch.Tensor] = []

    def note(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    _rebuilt(state, note, {}, 0)
    return found


Key = tuple[str, int]
"""A storage: its device and address."""


def storage_key(tensor: torch.Tensor) -> Key:
    return tensor.device.type, tensor.untyped_storage().data_ptr()


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as the ``cuda:N`` its tensors report (their device compares unequal otherwise)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages on ``device`` that ``tensors`` view."""
    sizes = {
        storage_key(t): t.untyped_storage().nbytes() for t in tensors if t.device == device and t.numel()
    }
    return sum(sizes.values())


@dataclass
class StateParking:
    """Where the step loop's preempted states go while the memory budget needs their room."""

    device: torch.device
    """The stage's device, where running states live."""
    room: int
    """Bytes the stage's memory budget leaves beside its weights: a step's activations and the states on
    the device keep within it."""
    need: Callable[[Any], int]
    """A request's activations in a step (the engine's estimate)."""
    host: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        self.device = _indexed(torch.device(self.device))

    def resident_bytes(self, states: Iterable[Any]) -> int:
        """Device memory the states hold (storages they share counted once)."""
        return storage_bytes((t for state in states for t in state_tensors(state)), self.device)

    def park(self, state: Any, kept: Iterable[Any] = ()) -> Parked:
        """Move the state's tensors to host memory, but those a ``kept`` state reaches too (moving them
        would free nothing)."""
        shared = {storage_key(t) for other in kept for t in state_tensors(other)}
        pinned = self.device.type == "cuda"
        return self._relocate(state, self.device, self.host, lambda key: key not in shared, pinned)

    def resume(self, state: Any, parked: Parked) -> int:
        """Bring what :meth:`park` moved back to the device (what was in host memory before stays);
        returns the bytes moved."""
        return self._relocate(state, self.host, self.device, parked.storages.__contains__, False).bytes

    def _relocate(
        self,
        state: Any,
        source: torch.device,
        target: torch.device,
        moves: Callable[[Key], bool],
        pinned: bool,
    ) -> Parked:
        """Every tensor of ``state`` on ``source`` whose storage ``moves`` rebuilt on ``target``, the state's
        own fields set in place (layers know the state by identity)."""
        moved: dict[Key, torch.UntypedStorage] = {}
        asynchronous = source.type == "cuda" or target.type == "cuda"

        def move(tensor: torch.Tensor) -> torch.Tensor:
            key = storage_key(tensor)
            if tensor.device != source or not tensor.numel() or not moves(key):
                return tensor
            storage = moved.get(key)
            if storage is None:
                old = tensor.untyped_storage()
                if pinned:
                    storage = torch.empty(old.nbytes(), dtype=torch.uint8, pin_memory=True).untyped_storage()
                else:
                    storage = torch.UntypedStorage(old.nbytes(), device=target)
                storage.copy_(old, non_blocking=asynchronous)
                moved[key] = storage
            view = torch.empty(0, dtype=tensor.dtype, device=target)
            return view.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())

        memo: dict[int, Any] = {id(state): state}
        for name, value in (_children(state) or {}).items():
            new = _rebuilt(value, move, memo, 1)
            if new is not value:
                setattr(state, name, new)
        return Parked(
            frozenset((target.type, s.data_ptr()) for s in moved.values()),
            sum(s.nbytes() for s in moved.values()),
        )


@dataclass(frozen=True)
class Parked:
    """What :meth:`StateParking.park` moved: the storages it made in host memory, and their bytes (the
    device memory parking freed, as far as nothing outside the loop's states holds it)."""

    storages: frozenset[Key]
    bytes: int
