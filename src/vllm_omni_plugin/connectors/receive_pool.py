"""Registered receive buffers for the connectors whose receivers pull into registered memory (NIXL,
Mooncake): registering memory with a transport is slow and pins pages, so buffers are registered once
and reused, and a value is handed out as a view of its buffer."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from vllm_omni_plugin.log import best_effort, get_logger

logger = get_logger(__name__)

MIN_POOL_BUFFER = 64 << 10


class ReceivePool:
    """Registered receive buffers by power-of-two capacity, ``limit_bytes`` in all; a buffer is lent out
    as a tensor view and comes back when that view is garbage collected. A value too large for what is
    left gets a one-off buffer, registered for its read and deregistered after it."""

    def __init__(
        self,
        register: Callable[[torch.Tensor], Any],
        deregister: Callable[[Any], object],
        limit_bytes: int,
        transport: str,
    ) -> None:
        self.register = register
        self.deregister = deregister
        self.limit = limit_bytes
        self.transport = transport
        self.lock = threading.RLock()  # a finalizer may run inside an acquire of the same thread
        self.free: dict[int, list[torch.Tensor]] = {}
        self.registrations: dict[int, Any] = {}
        """Pool buffer address -> its registration."""
        self.one_off: dict[int, Any] = {}
        """Address of a buffer outside the pool (a value too large for it) -> its registration."""
        self.total = 0
        self.closed = False

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """A registered buffer of at least ``nbytes`` and whether it belongs to the pool."""
        capacity = max(MIN_POOL_BUFFER, 1 << (nbytes - 1).bit_length())
        evicted: list[Any] = []
        with self.lock:
            bucket = self.free.get(capacity)
            if bucket:
                return bucket.pop(), True
            # Make room by dropping idle buffers of other sizes, largest first.
            while self.total + capacity > self.limit and capacity <= self.limit and self.free:
                size = max(self.free)
                victim = self.free[size].pop()
                if not self.free[size]:
                    del self.free[size]
                self.total -= size
                evicted.append(self.registrations.pop(victim.data_ptr()))
            pooled = self.total + capacity <= self.limit
            if pooled:
                self.total += capacity
        for registration in evicted:
            with best_effort(f"deregistering an evicted {self.transport} receive buffer", logger):
                self.deregister(registration)
        buffer = torch.empty(capacity if pooled else nbytes, dtype=torch.uint8)
        try:
            registration = self.register(buffer)
        except BaseException:
            if pooled:
                with self.lock:
                    self.total -= capacity
            raise
        with self.lock:
            (self.registrations if pooled else self.one_off)[buffer.data_ptr()] = registration
        return buffer, pooled

    def give_back(self, buffer: torch.Tensor) -> None:
        with self.lock:
            if not self.closed:
                self.free.setdefault(buffer.numel(), []).append(buffer)

    def drop_one_off(self, buffer: torch.Tensor) -> None:
        with self.lock:
            registration = self.one_off.pop(buffer.data_ptr(), None)
        if registration is not None:
            with best_effort(f"deregistering a one-off {self.transport} receive buffer", logger):
                self.deregister(registration)

    def release(self, buffer: torch.Tensor, pooled: bool) -> None:
        """A buffer whose read failed: back to the pool, or deregistered."""
        if pooled:
            self.give_back(buffer)
        else:
            self.drop_one_off(buffer)

    def deliver(self, buffer: torch.Tensor, pooled: bool, nbytes: int) -> torch.Tensor:
        """The read value: a view of a pooled buffer that returns it when collected, or the one-off
        buffer itself (deregistered: nothing reads into it any more)."""
        if not pooled:
            self.drop_one_off(buffer)
            return buffer
        view = buffer.numpy()[:nbytes]
        weakref.finalize(view, self.give_back, buffer)
        return torch.from_numpy(view)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            registrations, self.registrations = self.registrations, {}
            self.free.clear()
        for registration in registrations.values():
            with best_effort(f"deregistering {self.transport} receive buffers", logger):
                self.deregister(registration)
