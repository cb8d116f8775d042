"""The connector interface: stages exchange small handles; connectors hold the large values behind them.

A stage that produced a tensor calls :meth:`OmniConnector.put` and sends the returned
:class:`ConnectorHandle` (a small msgspec struct) in its control message; the consuming stage passes the
handle to :meth:`OmniConnector.get` of a connector built from the same deploy-config entry. Every value
is read at most once: ``get`` releases it, :meth:`OmniConnector.cleanup` releases it unread.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal, Self

import msgspec
import torch

from vllm_omni_plugin.connectors import CONNECTOR_CLASSES
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

Value = torch.Tensor | bytes | bytearray | memoryview
"""What ``put`` accepts."""


class ConnectorError(RuntimeError):
    """A connector could not store or deliver a value; the message names the handle."""


class ConnectorTimeoutError(ConnectorError, TimeoutError):
    """A value was released before it was collected (its lease ran out), or did not arrive in time."""


class RemoteLocation(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Where a value lives in another process's registered memory (connectors that pull, e.g. NIXL).

    ``metadata`` is the owner agent's metadata for this registration, connection info included, so a
    receiver can read the value without a round trip to the owner.
    """

    agent: str
    metadata: bytes
    addr: int
    device_id: int = 0
    mem_type: str = "DRAM"


HANDLE_KEY = "__omni_connector_handle__"
"""A handle inside plain message data is the one-key dict ``{HANDLE_KEY: handle fields}``: whoever puts
a value (a stage client, the AR runner's context export) and whoever fetches it agree on this form."""


class ConnectorHandle(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a control message carries in place of a value.

    ``dtype`` and ``shape`` are set for tensors only. The remaining fields are connector specific and
    travel so that the receiving side can explain a failure without asking the sender.
    """

    connector: str
    """The deploy-config name of the connector that stored the value."""
    key: str
    kind: Literal["tensor", "bytes"]
    nbytes: int
    dtype: str | None = None
    """Torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``."""
    shape: tuple[int, ...] | None = None
    owner_pid: int = 0
    """Process that stored the value (and frees it if nobody collects it)."""
    created_at: float = 0.0
    """Wall-clock time of the put (``time.time()``)."""
    lease_timeout_s: float = 0.0
    """Seconds the owner keeps an uncollected value; 0: until it closes."""
    remote: RemoteLocation | None = None


class ConnectorHealth(msgspec.Struct, kw_only=True):
    """Counters of one connector object, as seen from its own process."""

    puts: int = 0
    gets: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    errors: int = 0
    """Failed puts and gets, other than timeouts."""
    timeouts: int = 0
    """Values released because their lease ran out, plus gets that found such a value gone."""
    outstanding: int = 0
    """Values put here and not yet released (collected, cleaned up, expired or closed)."""
    acks: int = 0
    """Values put here that a receiver confirmed it read (connectors whose receivers acknowledge)."""
    bytes_acked: int = 0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Resolve a handle's dtype; a handle is external input, so only real torch dtypes are accepted."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConnectorError(f"handle names an unknown dtype {name!r}")
    return dtype


ValueKind = Literal["tensor", "bytes"]


def contiguous_value(value: Value) -> tuple[torch.Tensor, ValueKind, str | None, tuple[int, ...] | None]:
    """What ``put`` stores for ``value``, as one contiguous tensor: (tensor, kind, dtype, shape).

    Connectors that hand a transport the value's own memory (NIXL, Mooncake) register this tensor;
    bytes-like values are copied once (the caller may reuse a mutable buffer). A TypeError for anything
    else."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        return tensor, "tensor", dtype_name(tensor.dtype), tuple(tensor.shape)
    if isinstance(value, bytes | bytearray | memoryview):
        tensor = torch.frombuffer(bytearray(value), dtype=torch.uint8) if len(value) else torch.empty(0)
        return tensor, "bytes", None, None
    raise TypeError(f"cannot put a {type(value).__name__}; expected a tensor or bytes")


def as_value(data: torch.Tensor, handle: ConnectorHandle) -> torch.Tensor | bytes:
    """Raw bytes (uint8, flat) -> what was put: a tensor of the handle's dtype and shape, or bytes."""
    if handle.kind == "bytes":
        return data.numpy().tobytes()
    dtype = dtype_from_name(handle.dtype or "uint8")
    flat = data.view(dtype) if data.numel() else torch.empty(0, dtype=dtype)
    return flat.reshape(handle.shape if handle.shape is not None else (flat.numel(),))


class _Stats:
    """Counters shared by a connector and its helpers (a reaper thread), behind one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.health = ConnectorHealth()

    def add(self, **deltas: int) -> None:
        with self.lock:
            for field, delta in deltas.items():
                setattr(self.health, field, getattr(self.health, field) + delta)

    def snapshot(self, outstanding: int) -> ConnectorHealth:
        with self.lock:
            return msgspec.structs.replace(self.health, outstanding=outstanding)


class ConnectorSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A connector's ``extra`` settings. Each connector class declares its own subclass; an unknown key
    or a mistyped value is an error, found when the deploy config is resolved (before anything starts)
    and again when a connector is built from a plain dict."""


class OmniConnector(ABC):
    """Moves tensors and byte strings between stages; built as ``Cls(name, extra)`` from a deploy config.

    Implementations are thread-safe: the orchestrator calls them from several threads.
    """

    Settings: ClassVar[type[ConnectorSettings]] = ConnectorSettings
    """What ``extra`` may hold (the class without fields: nothing)."""
    device_memory: ClassVar[bool] = False
    """Whether ``put`` takes device tensors where they lie; False: callers move them to the host first."""

    def __init__(self, name: str, extra: dict[str, Any] | None = None) -> None:
        self.name = name
        self.settings = self.parse_settings(name, extra)
        self._stats = _Stats()

    @classmethod
    def parse_settings(cls, name: str, extra: dict[str, Any] | None) -> Any:
        """``extra`` as this class's ``Settings``; a ValueError naming the connector and the key."""
        try:
            return msgspec.convert(dict(extra or {}), cls.Settings)
        except msgspec.ValidationError as exc:
            message, _, where = str(exc).partition(" - at `$.")
            key = where.rstrip("`").split(".")[0].split("[")[0]
            unknown = message.removeprefix("Object contains unknown field `")
            known = ", ".join(f.encode_name for f in msgspec.structs.fields(cls.Settings)) or "none"
            if unknown != message:
                text = f"unknown {cls.__name__} extra key {unknown.rstrip('`')!r} (known: {known})"
            else:
                text = f"{cls.__name__} extra {key!r}: " + (
                    message.replace("`", "").replace("Expected", "expected").replace("array", "list")
                )
            raise ValueError(f"connector {name!r}: {text}") from None

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this class cannot be built here (a transport that is not installed), checked when a
        deploy config that uses it is resolved; None when it can."""
        return None

    @abstractmethod
    def put(self, value: Value) -> ConnectorHandle:
        """Store ``value`` (a tensor on any device, or bytes-like) until a ``get`` or ``cleanup``."""

    @abstractmethod
    def get(self, handle: ConnectorHandle, timeout: float | None = None) -> torch.Tensor | bytes:
        """Return the value behind ``handle`` and release it; tensors come back on the CPU.

        ``timeout`` bounds how long to wait for a value that is still in transit; connectors whose
        values are complete once the handle exists have nothing to wait for.
        """

    @abstractmethod
    def cleanup(self, handle: ConnectorHandle) -> None:
        """Release the value behind ``handle`` without reading it (e.g. the request was aborted)."""

    @abstractmethod
    def close(self) -> None:
        """Release every value this side still owns; the connector is unusable afterwards."""

    @abstractmethod
    def _outstanding(self) -> int:
        """Values put here and not yet released."""

    def health(self) -> ConnectorHealth:
        return self._stats.snapshot(outstanding=self._outstanding())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class InProcessConnector(OmniConnector):
    """Hands objects over within one process (stages sharing a process): no copy, no serialisation.

    The stored tensor is the caller's own object, so the producer must not modify it after ``put``.
    """

    def __init__(self, name: str, extra: dict[str, Any] | None = None) -> None:
        super().__init__(name, extra)
        self._lock = threading.Lock()
        self._values: dict[str, torch.Tensor | bytes] = {}
        self._next = 0
        self._closed = False

    def put(self, value: Value) -> ConnectorHandle:
        if isinstance(value, torch.Tensor):
            stored: torch.Tensor | bytes = value
            kind: Literal["tensor", "bytes"] = "tensor"
            nbytes = value.numel() * value.element_size()
            dtype, shape = dtype_name(value.dtype), tuple(value.shape)
        elif isinstance(value, bytes | bytearray | memoryview):
            # bytes are immutable, so only mutable buffers are copied.
            stored = value if isinstance(value, bytes) else bytes(value)
            kind, nbytes, dtype, shape = "bytes", len(stored), None, None
        else:
            self._stats.add(errors=1)
            raise TypeError(f"{self.name}: cannot put a {type(value).__name__}; expected a tensor or bytes")
        with self._lock:
            if self._closed:
                raise ConnectorError(f"connector {self.name!r} is closed")
            key = f"{self.name}:{self._next}"
            self._next += 1
            self._values[key] = stored
        self._stats.add(puts=1, bytes_put=nbytes)
        return ConnectorHandle(
            connector=self.name, key=key, kind=kind, nbytes=nbytes, dtype=dtype, shape=shape
        )

    def get(self, handle: ConnectorHandle, timeout: float | None = None) -> torch.Tensor | bytes:
        with self._lock:
            value = self._values.pop(handle.key, None)
        if value is None:
            self._stats.add(errors=1)
            raise ConnectorError(
                f"{self.name}: no value for handle {handle.key!r} (already collected, cleaned up, "
                "or put through another connector or process)"
            )
        self._stats.add(gets=1, bytes_got=handle.nbytes)
        return value

    def cleanup(self, handle: ConnectorHandle) -> None:
        with self._lock:
            self._values.pop(handle.key, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._values.clear()

    def _outstanding(self) -> int:
        with self._lock:
            return len(self._values)


def connector_class(spec_name: str, class_name: str) -> type[OmniConnector]:
    """The class a deploy config names (imported on first use; heavy transports load in ``__init__``)."""
    target = CONNECTOR_CLASSES.get(class_name)
    if target is None:
        raise ValueError(
            f"connector {spec_name!r}: unknown connector class {class_name!r} "
            f"(known: {', '.join(sorted(CONNECTOR_CLASSES))})"
        )
    try:
        cls = import_object(target)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"connector {spec_name!r}: cannot load {class_name} from {target}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, OmniConnector)):
        raise TypeError(f"connector {spec_name!r}: {target} is not an OmniConnector subclass")
    return cls


def make_connector(spec_name: str, class_name: str, extra: dict[str, Any] | None = None) -> OmniConnector:
    """Build the connector a deploy config names."""
    cls = connector_class(spec_name, class_name)
    logger.debug("connector %s: %s(%s)", spec_name, class_name, extra)
    return cls(spec_name, dict(extra or {}))
