"""The wire of a denoiser group (``peer_group.py``): how one message between two ranks travels over gloo.

A message is its header, msgspec (msgpack) as every other stage message and never a pickle, and its
tensors' bytes after it, in one buffer: the header holds the message's structure with each tensor replaced
by where its bytes lie (:class:`TensorPart`: offset, size, shape, dtype). What a denoiser call carries
besides tensors travels as itself: None, bools, ints, floats, strings, lists, tuples and dicts of them
(string keys), and a diffusers ``BaseOutput`` (a denoiser's ``Transformer2DModelOutput``) as its class's
import path and its fields. Anything else (an arbitrary object) is a :class:`WireError` at the sender,
naming its type and where it is, before anything is sent.

A link between two ranks keeps the receive of the next message's first part posted before the sender
sends it, so that a step's message, whatever its size, is one gloo send into a waiting receive (gloo's
slow path for an unexpected message costs an extra round trip).
"""

from __future__ import annotations

import importlib
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from vllm_omni_plugin.diffusion.step_batching import is_tensor


class WireError(TypeError):
    """A value the wire cannot carry, named by its type and its place in the message."""


# --- the messages, as the group and its peers use them ----------------------------------------------------


@dataclass(frozen=True)
class Kept:
    """A kept argument of a call (``peer_group.PeerKept``): its key alone where the peer holds it, else the
    key, its class's import path (:func:`class_path`) and its state."""

    key: Hashable
    cls: str | None = None
    state: Any = None


@dataclass(frozen=True)
class Call:
    """A call for a peer to compute: ``"rows"``, a forward of its own; ``"sequence"``, its part of a
    sequence-parallel one."""

    mode: Literal["rows", "sequence"]
    kwargs: dict[str, Any]
    kept: dict[str, Kept] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    """A peer's output of a call (None for its part of a sequence-parallel one)."""

    output: Any


@dataclass(frozen=True)
class Failure:
    """A peer's call raised: its message."""

    message: str


@dataclass(frozen=True)
class Stop:
    """The peer leaves."""


Message = Call | Reply | Failure | Stop


# --- the header ------------------------------------------------------------------------------------------


class TensorPart(msgspec.Struct, frozen=True, tag="tensor"):
    """Where a tensor of a message lies in its data: ``nbytes`` from ``offset``, then viewed as ``dtype``
    (torch's name, ``float32``) in ``shape``."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


class Items(msgspec.Struct, frozen=True, tag="items"):
    """A list, or a tuple."""

    items: list[Value]
    is_tuple: bool = False


class Fields(msgspec.Struct, frozen=True, tag="dict"):
    """A dict (string keys)."""

    items: dict[str, Value]


class Output(msgspec.Struct, frozen=True, tag="output"):
    """A diffusers ``BaseOutput``: its class (:func:`class_path`) and its fields."""

    cls: str
    fields: dict[str, Value]


Value = None | bool | int | float | str | TensorPart | Items | Fields | Output
"""A value in a header (a union of tagged structs: msgpack has one array and one map type)."""


class _Kept(msgspec.Struct, frozen=True):
    key: Value
    cls: str | None = None
    state: Value = None


class _Call(msgspec.Struct, frozen=True, tag="call"):
    mode: Literal["rows", "sequence"]
    kwargs: dict[str, Value]
    kept: dict[str, _Kept] = {}


class _Reply(msgspec.Struct, frozen=True, tag="reply"):
    output: Value


class _Failure(msgspec.Struct, frozen=True, tag="failure"):
    message: str


class _Stop(msgspec.Struct, frozen=True, tag="stop"):
    pass


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Call | _Reply | _Failure | _Stop)

ALIGN = 16
"""Each tensor's bytes start at a multiple of this (a view as a wider dtype needs its offset aligned)."""
_INT_RANGE = (-(2**63), 2**64 - 1)
"""The ints msgpack holds."""


def class_path(cls: type) -> str:
    """``module:qualname`` of a class (what :func:`resolve_class` imports again)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_class(path: str) -> type:
    """The class :func:`class_path` named."""
    module, _, qualname = path.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    if not isinstance(found, type):
        raise WireError(f"{path} is no class")
    return found


def _base_output() -> type:
    from diffusers.utils import BaseOutput

    return BaseOutput


class _Parts:
    """The tensors of a message as they are stripped out of its header: their host bytes, padded."""

    def __init__(self) -> None:
        self.tensors: list[Any] = []
        self.offset = 0

    def strip(self, value: Any, where: str) -> Value:
        """``value`` as the header holds it (``where``: its place in the message, for an error)."""
        kind = type(value)
        if value is None or kind in (bool, float, str):
            return value
        if kind is int:
            if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
                raise WireError(
                    f"the denoiser group's wire cannot carry the int {value} ({where}): too large"
                )
            return value
        if is_tensor(value):
            return self._tensor(value)
        if kind is list or kind is tuple:
            return Items([self.strip(v, f"{where}[{i}]") for i, v in enumerate(value)], kind is tuple)
        if kind is dict:
            bad = next((k for k in value if type(k) is not str), None)
            if bad is not None:
                key = type(bad).__qualname__
                raise WireError(f"the denoiser group's wire cannot carry a dict keyed by {key} ({where})")
            return Fields({k: self.strip(v, f"{where}[{k!r}]") for k, v in value.items()})
        if hasattr(value, "to_tuple") and isinstance(value, _base_output()):
            return Output(class_path(kind), {k: self.strip(v, f"{where}.{k}") for k, v in value.items()})
        raise WireError(
            f"the denoiser group's wire cannot carry {kind.__module__}.{kind.__qualname__} ({where}): "
            "tensors, None, bools, ints, floats, strings, lists, tuples, dicts of them and diffusers "
            "outputs travel"
        )

    def _tensor(self, value: Any) -> TensorPart:
        import torch

        flat = value.detach().to("cpu").reshape(-1)
        if flat.stride() != (1,):  # an expanded tensor (a step's timestep for every row): stride 0
            flat = torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)
        raw = flat.view(torch.uint8)
        part = TensorPart(
            self.offset, raw.numel(), tuple(value.shape), str(value.dtype).removeprefix("torch.")
        )
        pad = -raw.numel() % ALIGN
        self.tensors.append(raw if not pad else torch.cat([raw, raw.new_zeros(pad)]))
        self.offset += raw.numel() + pad
        return part


def _header(message: Message, parts: _Parts) -> msgspec.Struct:
    if isinstance(message, Call):
        kwargs = {name: parts.strip(value, f"argument {name}") for name, value in message.kwargs.items()}
        kept = {
            name: _Kept(
                parts.strip(k.key, f"the key of argument {name}"),
                k.cls,
                parts.strip(k.state, f"the state of argument {name}"),
            )
            for name, k in message.kept.items()
        }
        return _Call(message.mode, kwargs, kept)
    if isinstance(message, Reply):
        return _Reply(parts.strip(message.output, "the output"))
    if isinstance(message, Failure):
        return _Failure(message.message)
    return _Stop()


def encode(message: Message) -> Any:
    """``message`` as one buffer (a uint8 tensor): its header's length, its header, its tensors' bytes.
    :class:`WireError` where it holds what the wire cannot carry."""
    import torch

    parts = _Parts()
    header = _ENCODER.encode(_header(message, parts))
    start = 8 + len(header)
    pad = -start % ALIGN
    prefix = torch.frombuffer(
        bytearray(len(header).to_bytes(8, "little") + header + bytes(pad)), dtype=torch.uint8
    )
    return torch.cat([prefix, *parts.tensors]) if parts.tensors else prefix


def _fill(value: Value, data: Any, device: Any) -> Any:
    """The value a header's ``value`` stands for, its tensors views of ``data`` (or on ``device``)."""
    if isinstance(value, TensorPart):
        import torch

        dtype = getattr(torch, value.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise WireError(f"a tensor of unknown dtype {value.dtype!r}")
        tensor = data[value.offset : value.offset + value.nbytes].view(dtype).reshape(value.shape)
        return tensor if device is None else tensor.to(device)
    if isinstance(value, Items):
        items = [_fill(v, data, device) for v in value.items]
        return tuple(items) if value.is_tuple else items
    if isinstance(value, Fields):
        return {k: _fill(v, data, device) for k, v in value.items.items()}
    if isinstance(value, Output):
        cls = resolve_class(value.cls)
        if not issubclass(cls, _base_output()):
            raise WireError(f"{value.cls} is no diffusers output")
        return cls(**{k: _fill(v, data, device) for k, v in value.fields.items()})
    return value


def decode(buffer: Any, device: Any = None) -> Message:
    """The message :func:`encode` made (its tensors on ``device``; views of ``buffer`` where None)."""
    size = int.from_bytes(buffer[:8].numpy().tobytes(), "little")
    header = _DECODER.decode(buffer[8 : 8 + size].numpy().tobytes())
    start = 8 + size
    data = buffer[start + (-start % ALIGN) :]
    if isinstance(header, _Call):
        kept = {
            name: Kept(_fill(k.key, data, device), k.cls, _fill(k.state, data, device))
            for name, k in header.kept.items()
        }
        kwargs = {name: _fill(value, data, device) for name, value in header.kwargs.items()}
        return Call(header.mode, kwargs, kept)
    if isinstance(header, _Reply):
        return Reply(_fill(header.output, data, device))
    if isinstance(header, _Failure):
        return Failure(header.message)
    return Stop()


# --- the link --------------------------------------------------------------------------------------------

FIRST_PART = 64 * 1024
"""The least size of a message's first part, which is sent whole (padded): the receiver has its receive
posted before the sender sends it: gloo takes a slow path (an extra round trip) for a message that arrives
before its receive is posted."""
LARGEST_FIRST_PART = 8 * 1024 * 1024
"""The most a first part grows to (a longer message follows its first part whole, in a second send)."""


def first_part(length: int) -> int:
    """The size of the first part after a message of ``length`` bytes, on both ends of a link: a quarter
    over it, in whole :data:`FIRST_PART` units (a step's messages keep their size; the next fits whole)."""
    wanted = length + length // 4 + ALIGN
    return min(LARGEST_FIRST_PART, max(FIRST_PART, -(-wanted // FIRST_PART) * FIRST_PART))


class Link:
    """The messages between this rank and one other, in order each way: each one (:func:`encode`) within a
    first part after its length where it fits, else after that part; the receive of the next first part
    is always posted, its size following the last message's the same way on both ends
    (:func:`first_part`)."""

    def __init__(self, group: Any, rank: int) -> None:
        self._group = group
        self._rank = rank
        self._sending = FIRST_PART
        self._receiving = FIRST_PART
        self._post()

    def send(self, buffer: Any) -> None:
        """Send a message :func:`encode` made."""
        import torch

        length = buffer.numel()
        inline = length <= self._sending - ALIGN
        first = torch.zeros(self._sending, dtype=torch.uint8)
        first[:ALIGN] = torch.frombuffer(bytearray(length.to_bytes(ALIGN, "little")), dtype=torch.uint8)
        if inline:
            first[ALIGN : ALIGN + length] = buffer
        self._sending = first_part(length)
        self._group.send([first], self._rank, 0).wait()
        if not inline:
            self._group.send([buffer], self._rank, 0).wait()

    def _post(self) -> None:
        import torch

        self._first = torch.empty(self._receiving, dtype=torch.uint8)
        self._work = self._group.recv([self._first], self._rank, 0)

    def take(self, device: Any = None) -> Message:
        """The next message (its tensors on ``device``; views of the received bytes where None)."""
        import torch

        self._work.wait()
        first = self._first
        length = int.from_bytes(first[:8].numpy().tobytes(), "little")
        if length <= first.numel() - ALIGN:
            buffer = first[ALIGN : ALIGN + length]
        else:
            buffer = torch.empty(length, dtype=torch.uint8)
            self._group.recv([buffer], self._rank, 0).wait()
        self._receiving = first_part(length)
        self._post()  # a new buffer: the tensors of this message stay views of the old one
        return decode(buffer, device)
