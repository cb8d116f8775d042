"""The wire of a denoiser group (``peer_group.py``): how one message between two ranks travels over gloo.

A message is its header (the structure of the value, each tensor replaced by where its bytes lie) and its
tensors' bytes after it, in one buffer. A link between two ranks keeps the receive of the next message's
first part posted before the sender sends it, so that a step's message, whatever its size, is one gloo
send into a waiting receive (gloo's slow path for an unexpected message costs an extra round trip).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from vllm_omni_plugin.diffusion.step_batching import is_tensor


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


def encode(value: Any) -> Any:
    """``value`` as one message: a uint8 tensor of its header's length, its header and its tensors."""
    import torch

    tensors: list[Any] = []
    header = pickle.dumps(_strip(value, tensors, [0]))
    start = 8 + len(header)
    pad = -start % ALIGN
    prefix = torch.frombuffer(
        bytearray(len(header).to_bytes(8, "little") + header + bytes(pad)), dtype=torch.uint8
    )
    return torch.cat([prefix, *tensors]) if tensors else prefix


def decode(message: Any, device: Any = None) -> Any:
    """The value of a message :func:`encode` made (its tensors on ``device``; views of ``message``'s bytes
    where None)."""
    size = int.from_bytes(message[:8].numpy().tobytes(), "little")
    structure = pickle.loads(message[8 : 8 + size].numpy().tobytes())
    start = 8 + size
    return _fill(structure, message[start + (-start % ALIGN) :], device)


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

    def send(self, message: Any) -> None:
        """Send a message :func:`encode` made."""
        import torch

        length = message.numel()
        inline = length <= self._sending - ALIGN
        first = torch.zeros(self._sending, dtype=torch.uint8)
        first[:ALIGN] = torch.frombuffer(bytearray(length.to_bytes(ALIGN, "little")), dtype=torch.uint8)
        if inline:
            first[ALIGN : ALIGN + length] = message
        self._sending = first_part(length)
        self._group.send([first], self._rank, 0).wait()
        if not inline:
            self._group.send([message], self._rank, 0).wait()

    def _post(self) -> None:
        import torch

        self._first = torch.empty(self._receiving, dtype=torch.uint8)
        self._work = self._group.recv([self._first], self._rank, 0)

    def take(self, device: Any = None) -> Any:
        """The next message's value (its tensors on ``device``; views of the received bytes where None)."""
        import torch

        self._work.wait()
        first = self._first
        length = int.from_bytes(first[:8].numpy().tobytes(), "little")
        if length <= first.numel() - ALIGN:
            message = first[ALIGN : ALIGN + length]
        else:
            message = torch.empty(length, dtype=torch.uint8)
            self._group.recv([message], self._rank, 0).wait()
        self._receiving = first_part(length)
        self._post()  # a new buffer: the tensors of this message stay views of the old one
        return decode(message, device)
