"""What the connectors whose receivers pull (NIXL, Mooncake) share: the owner keeps each put value
registered until its reader acknowledges, the value is cleaned up or its lease runs out; the receiver
checks a handle, READs it into its registered receive pool, and refuses a second read of one handle.

A subclass provides the transport: ``transport`` (its name in messages), ``endpoint`` (this object's
address as handles name it), ``_pool``, ``_expose`` (register a put value and say where it lies),
``_read`` (one READ into a pool buffer), ``_drop_region`` (what a released value held), ``_send_release``
(ask a remote owner to release an unread value) and, where acknowledgements do not ride the READ itself,
``_acknowledge``.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_omni_plugin.connectors.base import (
    ConnectorError,
    ConnectorHandle,
    ConnectorTimeoutError,
    OmniConnector,
    RemoteLocation,
    Value,
    as_value,
    contiguous_value,
)
from vllm_omni_plugin.connectors.receive_pool import ReceivePool
from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

LEASE_MARGIN = (1.0, 0.1)
"""A receiver does not start a READ this close to the end of a value's lease: the lesser of 1 s and a
tenth of the lease."""
COLLECTED_MEMORY = 1 << 16
"""How many collected or cleaned-up keys a receiver remembers to refuse a second ``get`` of a handle."""


@dataclass
class Owned:
    tensor: torch.Tensor
    region: tuple[int, ...]
    nbytes: int
    deadline: float
    """Monotonic time at which the lease runs out (inf without a lease)."""


class PullingConnector(OmniConnector):
    """See the module docstring. Thread-safe."""

    transport: ClassVar[str]
    endpoint: str
    _pool: ReceivePool

    def __init__(self, name: str, extra: dict[str, Any] | None = None) -> None:
        super().__init__(name, extra)
        self.lease_timeout_s: float = self.settings.lease_timeout_s
        """Seconds the owner keeps an uncollected value (every subclass's settings have it); 0: until it
        closes."""
        self._lock = threading.Lock()
        self._owned: dict[str, Owned] = {}
        self._closed = False
        self._abandoned: list[torch.Tensor] = []
        """Receive buffers of timed-out READs, kept alive because the transfer may still write them."""
        self._collected: OrderedDict[str, None] = OrderedDict()
        """Keys this side read or cleaned up: a second READ would see memory the owner has released,
        which some transports (e.g. UCX cma) deliver without an error."""

    # --- owner side ---------------------------------------------------------------------------------

    def put(self, value: Value) -> ConnectorHandle:
        try:
            tensor, kind, dtype, shape = contiguous_value(value)
        except TypeError as exc:
            self._stats.add(errors=1)
            raise TypeError(f"{self.name}: {exc}") from None
        nbytes = tensor.numel() * tensor.element_size()
        key = secrets.token_hex(8)
        with self._lock:
            if self._closed:
                raise ConnectorError(f"connector {self.name!r} is closed")
            try:
                tensor, region, remote = self._expose(tensor, nbytes)
            except Exception as exc:
                self._stats.add(errors=1)
                what = f"{self.name}: {self.transport} could not register {nbytes} bytes"
                raise ConnectorError(f"{what}: {exc}") from exc
            if nbytes:  # an empty value has nothing to read, hence nothing to release
                self._own(key, tensor, region, nbytes)
        self._stats.add(puts=1, bytes_put=nbytes)
        self._after_put()
        return ConnectorHandle(
            connector=self.name,
            key=key,
            kind=kind,
            nbytes=nbytes,
            dtype=dtype,
            shape=shape,
            owner_pid=os.getpid(),
            created_at=time.time(),
            lease_timeout_s=self.lease_timeout_s,
            remote=remote,
        )

    @abstractmethod
    def _expose(
        self, tensor: torch.Tensor, nbytes: int
    ) -> tuple[torch.Tensor, tuple[int, ...], RemoteLocation]:
        """Register a put value (lock held; nothing to register when it is empty): the tensor whose
        memory is registered, its region (see ``_drop_region``) and where a receiver reads it."""

    def _after_put(self) -> None:
        """What the owner does once a value is put (e.g. wake its acknowledgement poller)."""

    def _own(self, key: str, tensor: torch.Tensor, region: tuple[int, ...], nbytes: int) -> None:
        """Keep a put value until it is released (lock held)."""
        lease = self.lease_timeout_s
        deadline = time.monotonic() + lease if lease > 0 else float("inf")
        self._owned[key] = Owned(tensor, region, nbytes, deadline)

    @abstractmethod
    def _drop_region(self, owned: Owned) -> None:
        """A released value no longer needs its registration (lock held)."""

    def _release(self, key: str, *, acked: bool = False, expired: bool = False) -> bool:
        with self._lock:
            owned = self._owned.pop(key, None)
            if owned is None:
                return False
            self._drop_region(owned)
        if acked:
            self._stats.add(acks=1, bytes_acked=owned.nbytes)
        if expired:
            self._stats.add(timeouts=1)
        return True

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [key for key, owned in self._owned.items() if now >= owned.deadline]
        for key in expired:
            self._release(key, expired=True)
        if expired:
            logger.warning(
                "%s: released %d value(s) not collected within the %.0f s lease",
                self.name,
                len(expired),
                self.lease_timeout_s,
            )

    def _outstanding(self) -> int:
        with self._lock:
            return len(self._owned)

    # --- receiver side -------------------------------------------------------------------------------

    def _made_here(self, remote: RemoteLocation) -> bool:
        """Whether a handle's remote location is of this class (subclasses may check more)."""
        return True

    def get(self, handle: ConnectorHandle, timeout: float | None = None) -> torch.Tensor | bytes:
        remote = handle.remote
        if remote is None or not self._made_here(remote):
            self._stats.add(errors=1)
            raise ConnectorError(
                f"{self.name}: handle {handle.key!r} was not made by a {type(self).__name__} (connector "
                f"{handle.connector!r})"
            )
        if handle.nbytes == 0:  # nothing was registered or kept: nothing to read or release
            self._stats.add(gets=1)
            return as_value(torch.empty(0, dtype=torch.uint8), handle)
        if remote.agent == self.endpoint:  # put and got in this process: hand the object over
            with self._lock:
                owned = self._owned.get(handle.key)
            if owned is None:
                self._stats.add(errors=1)
                raise ConnectorError(f"{self.name}: no value for handle {handle.key!r} (already collected?)")
            self._release(handle.key)
            self._stats.add(gets=1, bytes_got=handle.nbytes)
            return owned.tensor.numpy().tobytes() if handle.kind == "bytes" else owned.tensor
        lease = handle.lease_timeout_s
        margin = min(LEASE_MARGIN[0], lease * LEASE_MARGIN[1])
        if lease > 0 and time.time() > handle.created_at + lease - margin:
            self._stats.add(timeouts=1)
            raise ConnectorTimeoutError(
                f"{self.name}: value {handle.key!r} of {remote.agent} was not collected within its "
                f"{lease:g} s lease; its owner releases it (or has released it)"
            )
        if self._closed:
            raise ConnectorError(f"connector {self.name!r} is closed")
        if not self._remember(handle.key):
            self._stats.add(errors=1)
            raise ConnectorError(
                f"{self.name}: value {handle.key!r} of {remote.agent} was already collected or cleaned up"
            )
        buffer, pooled = self._pool.acquire(handle.nbytes)
        try:
            self._read(handle, remote, buffer, timeout)
        except ConnectorTimeoutError:
            self._abandoned.append(buffer)  # the READ may still land in this buffer: never reuse it
            raise
        except BaseException:
            with self._lock:  # not delivered: a retry may read it
                self._collected.pop(handle.key, None)
            self._pool.release(buffer, pooled)
            raise
        self._acknowledge(handle, remote)
        self._stats.add(gets=1, bytes_got=handle.nbytes)
        return as_value(self._pool.deliver(buffer, pooled, handle.nbytes), handle)

    @abstractmethod
    def _read(
        self, handle: ConnectorHandle, remote: RemoteLocation, buffer: torch.Tensor, timeout: float | None
    ) -> None:
        """READ the value into ``buffer``; ConnectorTimeoutError past the timeout, ConnectorError else."""

    def _acknowledge(self, handle: ConnectorHandle, remote: RemoteLocation) -> None:
        """Tell the owner its value was read (nothing where the READ itself carries the ack)."""

    def _remember(self, key: str) -> bool:
        """Record ``key`` as collected here; False if it already was."""
        with self._lock:
            if key in self._collected:
                return False
            self._collected[key] = None
            if len(self._collected) > COLLECTED_MEMORY:
                self._collected.popitem(last=False)
            return True

    def cleanup(self, handle: ConnectorHandle) -> None:
        remote = handle.remote
        if remote is None or self._release(handle.key) or remote.agent == self.endpoint:
            return  # released now, or (its own value) acknowledged or expired before
        self._remember(handle.key)
        self._send_release(handle, remote)

    @abstractmethod
    def _send_release(self, handle: ConnectorHandle, remote: RemoteLocation) -> None:
        """Ask the owner of an unread value to release it (best effort: its lease frees it otherwise)."""
