"""Tensors and bytes between stage processes, on one host or across hosts of an RDMA cluster, through
Mooncake's transfer engine (RDMA, or TCP where there is none). The receiver pulls:

* ``put`` registers the caller's tensor with this process's ``TransferEngine`` where it lies (no copy)
  and returns a handle naming the engine's session (``host:rpc_port``, the P2P handshake needs no
  metadata server), the address, and this connector's side channel.
* ``get`` READs the value into a buffer of its own receive pool (``memory_pool_size`` bytes of
  registered buffers, reused, so registration is paid once) and returns a tensor view of that buffer;
  the buffer goes back to the pool when the returned tensor is garbage collected. It then sends ``ack``
  over the side channel: the owner deregisters its value, so a second READ of it is refused by the
  owner's engine instead of reading reused memory.
* The side channel is a ZMQ PULL socket of the owner on ``host``, at ``zmq_port`` or the next free port
  above it (one per connector object on a host; the handle carries the port taken). ``cleanup`` on the
  receiving side sends ``release`` there. An uncollected value is released when its lease runs out
  (``lease_timeout_s``); ``close()`` releases everything.

Deploy config (vllm-omni's keys, with their meaning there): ``host`` (``auto``: this host's address on
its default route, else its first non-loopback one), ``zmq_port`` (50051), ``protocol`` (``rdma`` or
``tcp``), ``device_name`` (RDMA devices to use, comma-separated; empty: all, or ``RDMA_DEVICE_NAME``),
``memory_pool_size`` (bytes of receive buffers, 1 GiB), ``memory_pool_device`` (``cpu``); ours besides:
``transfer_timeout_s`` (30) and ``lease_timeout_s`` (300).
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.util
import math
import os
import socket
import struct
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal

import torch
import zmq
from msgspec import Meta

from vllm_omni_plugin.connectors.base import (
    ConnectorError,
    ConnectorHandle,
    ConnectorSettings,
    ConnectorTimeoutError,
    RemoteLocation,
)
from vllm_omni_plugin.connectors.pulling import Owned, PullingConnector
from vllm_omni_plugin.connectors.receive_pool import ReceivePool
from vllm_omni_plugin.log import best_effort, get_logger
from vllm_omni_plugin.processes import temporary_environment

logger = get_logger(__name__)

MOONCAKE_EXTRA = (
    "pip install 'vllm-omni-plugin[mooncake]' (mooncake-transfer-engine, the CUDA build), or "
    "mooncake-transfer-engine-non-cuda on a host without CUDA"
)
PORT_RANGE = 64
"""How many ports above ``zmq_port`` a connector tries for its side channel."""
ACK, RELEASE = b"ack:", b"release:"
OVERLAPPING_REGION = -7
"""``register_memory``'s answer for memory that overlaps a registration (e.g. a view of a received
value): such a value is copied into memory of its own first."""
PENDING, COMPLETED, ENGINE_TIMEOUT = 0, 1, -2
"""``transfer_check_status`` answers (also -1: failed); it frees the batch once the transfer completed
or failed."""
SUBMIT_FAILED = (0, (1 << 64) - 1)
"""``batch_transfer_async_read``'s batch id when it could not submit (no session with the peer: -1)."""
ENGINE_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
ENGINE_MIN_TIMEOUT_S = 5
_ENGINE_ENV_LOCK = threading.Lock()
POLL_SPIN_S = 0.002
POLL_PAUSE_MIN_S, POLL_PAUSE_MAX_S = 50e-6, 1e-3
RDMA_DEVICES = Path("/sys/class/infiniband")
SIOCGIFADDR = 0x8915


class MooncakeSettings(ConnectorSettings, frozen=True, kw_only=True):
    """``extra`` of a ``MooncakeTransferEngineConnector``."""

    host: str = "auto"
    """The address other hosts reach this one at; ``auto``: found from this host's interfaces."""
    zmq_port: Annotated[int, Meta(ge=0, le=65535)] = 50051
    """First port of the side channel (0: any free port)."""
    protocol: Literal["rdma", "tcp"] = "rdma"
    device_name: str = ""
    memory_pool_size: Annotated[int, Meta(ge=0)] = 1 << 30
    memory_pool_device: Literal["cpu"] = "cpu"
    """Where receive buffers live. Only host memory: values reach the stages through host memory, as
    with every connector here (``device_memory`` is False)."""
    transfer_timeout_s: Annotated[float, Meta(ge=1e-3)] = 30.0
    lease_timeout_s: Annotated[float, Meta(ge=0)] = 300.0
    """Seconds the owner keeps an uncollected value; 0: until it closes."""


def mooncake_missing() -> str | None:
    """Why this host cannot run the connector (the package is not installed), else None; cheap."""
    try:
        missing = importlib.util.find_spec("mooncake") is None
    except ValueError:  # sys.modules["mooncake"] is None: imports of it are blocked
        missing = True
    if missing:
        return f"MooncakeTransferEngineConnector needs Mooncake's transfer engine: {MOONCAKE_EXTRA}"
    return None


def load_mooncake() -> ModuleType:
    # By default every engine start and stop writes a dozen INFO lines to stderr. Failures reach the user
    # through this connector's own errors; Mooncake's errors still show (MC_LOG_LEVEL=INFO for all).
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:
        raise ImportError(
            f"MooncakeTransferEngineConnector needs Mooncake's transfer engine: {MOONCAKE_EXTRA} ({exc})"
        ) from None


def host_address() -> str:
    """This host's IPv4 address on its default route, else on its first non-loopback interface that has
    one, else 127.0.0.1 (a host alone)."""
    names = [name for _, name in socket.if_nameindex() if name != "lo"]
    try:
        routes = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        routes = []
    rows = [line.split() for line in routes]
    default = [fields[0] for fields in rows if len(fields) > 1 and fields[1] == "00000000"]
    for name in default + names:
        address = _interface_address(name)
        if address is not None:
            return address
    return "127.0.0.1"


def _interface_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("256s", name.encode()[:15])
        try:
            answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


class MooncakeTransferEngineConnector(PullingConnector):
    """See the module docstring. Thread-safe; one transfer engine per connector object."""

    Settings = MooncakeSettings
    transport = "Mooncake"

    @classmethod
    def unavailable(cls) -> str | None:
        return mooncake_missing()

    def __init__(self, name: str, extra: dict[str, Any] | None = None) -> None:
        super().__init__(name, extra)
        settings: MooncakeSettings = self.settings
        engine_module = load_mooncake()
        self.transfer_timeout_s = settings.transfer_timeout_s
        self.host = host_address() if settings.host in ("auto", "", "*", "0.0.0.0") else settings.host
        device_name = settings.device_name or os.environ.get("RDMA_DEVICE_NAME", "")
        if settings.protocol == "rdma" and not (RDMA_DEVICES.is_dir() and any(RDMA_DEVICES.iterdir())):
            # Mooncake starts an RDMA engine on a host without devices and fails only at the first READ.
            raise ConnectorError(
                f"connector {name!r}: protocol rdma, but this host has no RDMA device ({RDMA_DEVICES} is "
                "empty); use protocol: tcp, or install the RDMA drivers"
            )
        self.engine_timeout_s = max(ENGINE_MIN_TIMEOUT_S, math.ceil(settings.transfer_timeout_s))
        """The deadline of the engine's own blocking READ (``MC_TRANSFER_TIMEOUT``, read by its
        constructor; whole seconds, at least 5)."""
        with _ENGINE_ENV_LOCK, temporary_environment({ENGINE_TIMEOUT_ENV: str(self.engine_timeout_s)}):
            self.engine = engine_module.TransferEngine()
        code = self.engine.initialize(self.host, "P2PHANDSHAKE", settings.protocol, device_name)
        if code != 0:
            raise ConnectorError(
                f"connector {name!r}: Mooncake's transfer engine did not start on {self.host} "
                f"(protocol {settings.protocol}, devices {device_name or 'all'}): code {code}"
            )
        self.endpoint = f"{self.host}:{self.engine.get_rpc_port()}"
        """The engine's session id (``host:rpc_port``), which a READ names."""
        self._regions: dict[tuple[int, int], list[Any]] = {}
        """(address, bytes) -> [tensor kept registered, values using it]: a tensor put twice is
        registered once (Mooncake refuses overlapping registrations)."""
        self._pool = ReceivePool(
            self._register_buffer, self._unregister, settings.memory_pool_size, self.transport
        )
        self._zmq = zmq.Context()
        self._acks = self._zmq.socket(zmq.PULL)
        self._acks.setsockopt(zmq.LINGER, 0)
        self.side_channel = self._bind_side_channel(settings.zmq_port)
        self._senders: dict[str, zmq.Socket] = {}
        """Side channels of owners this side has talked to (used under ``_lock``)."""
        self._stop = threading.Event()
        self._listener = threading.Thread(target=self._listen, name=f"mooncake-{name}-acks", daemon=True)
        self._listener.start()
        logger.debug(
            "connector %s: Mooncake %s engine %s, side channel %s",
            name,
            settings.protocol,
            self.endpoint,
            self.side_channel,
        )

    def _bind_side_channel(self, first: int) -> str:
        if first == 0:
            port = self._acks.bind_to_random_port(f"tcp://{self.host}")
            return f"tcp://{self.host}:{port}"
        last = min(first + PORT_RANGE - 1, 65535)
        for port in range(first, last + 1):
            address = f"tcp://{self.host}:{port}"
            try:
                self._acks.bind(address)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EADDRINUSE:
                    continue
                self._acks.close(0)
                self._zmq.term()
                raise ConnectorError(f"connector {self.name!r}: cannot listen on {address}: {exc}") from None
            return address
        self._acks.close(0)
        self._zmq.term()
        raise ConnectorError(
            f"connector {self.name!r}: every port from zmq_port {first} to {last} on {self.host} is in use; "
            "set another zmq_port (or 0 for any free port)"
        )

    # --- registration ---------------------------------------------------------------------------------

    def _register_buffer(self, buffer: torch.Tensor) -> int:
        address = buffer.data_ptr()
        code = self.engine.register_memory(address, buffer.numel() * buffer.element_size())
        if code != 0:
            raise ConnectorError(f"{self.name}: Mooncake could not register {buffer.numel()} bytes ({code})")
        return address

    def _unregister(self, address: int) -> None:
        code = self.engine.unregister_memory(address)
        if code != 0:
            raise ConnectorError(f"{self.name}: Mooncake could not deregister {address:#x} (code {code})")

    # --- owner side -----------------------------------------------------------------------------------

    def _expose(
        self, tensor: torch.Tensor, nbytes: int
    ) -> tuple[torch.Tensor, tuple[int, ...], RemoteLocation]:
        tensor = tensor.cpu()  # device_memory is False: callers hand over host tensors already
        if nbytes:
            tensor = self._hold(tensor, nbytes)
        remote = RemoteLocation(
            agent=self.endpoint, metadata=self.side_channel.encode(), addr=tensor.data_ptr()
        )
        return tensor, (tensor.data_ptr(), nbytes), remote

    def _hold(self, tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
        """Keep ``tensor``'s memory registered for one more value (lock held); the tensor whose memory
        is registered (a copy where the memory overlaps a registration of something else)."""
        region = (tensor.data_ptr(), nbytes)
        entry = self._regions.get(region)
        if entry is None:
            code = self.engine.register_memory(*region)
            if code == OVERLAPPING_REGION:
                tensor = tensor.clone()
                region = (tensor.data_ptr(), nbytes)
                code = self.engine.register_memory(*region)
            if code != 0:
                raise ConnectorError(f"register_memory answered {code}")
            entry = self._regions[region] = [tensor, 0]
        entry[1] += 1
        return entry[0]

    def _drop_region(self, owned: Owned) -> None:
        entry = self._regions.get(owned.region)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:  # deregistered: a late READ of it is refused by this engine
                del self._regions[owned.region]
                with best_effort("deregistering a released Mooncake value", logger):
                    self._unregister(owned.region[0])

    def _listen(self) -> None:
        poller = zmq.Poller()
        poller.register(self._acks, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(200))
                while self._acks in ready:
                    message = self._acks.recv(zmq.NOBLOCK)
                    if message.startswith(ACK):
                        self._release(message[len(ACK) :].decode(errors="replace"), acked=True)
                    elif message.startswith(RELEASE):
                        self._release(message[len(RELEASE) :].decode(errors="replace"))
                    ready = dict(poller.poll(0))
                self._expire_leases()
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("%s: reading the Mooncake side channel failed", self.name)
            except Exception:  # keep releasing; one failed poll must not end the lease guarantee
                logger.exception("%s: handling the Mooncake side channel failed", self.name)

    # --- receiver side --------------------------------------------------------------------------------

    def _made_here(self, remote: RemoteLocation) -> bool:
        return remote.metadata.startswith(b"tcp://")  # the side channel, where NIXL keeps its metadata

    def _read(
        self, handle: ConnectorHandle, remote: RemoteLocation, buffer: torch.Tensor, timeout: float | None
    ) -> None:
        limit = self.transfer_timeout_s if timeout is None else min(timeout, self.transfer_timeout_s)
        what = (
            f"{self.name}: reading {handle.key!r} ({handle.nbytes} bytes) from {handle.connector!r} of "
            f"process {handle.owner_pid} at {remote.agent}"
        )
        if limit >= self.engine_timeout_s:
            # On this thread, without the GIL, until the engine's own deadline (no thread hop, no poll).
            start = time.monotonic()
            code = self.engine.transfer_sync_read(remote.agent, buffer.data_ptr(), remote.addr, handle.nbytes)
            if code == 0:
                return
            if time.monotonic() - start >= limit:  # the engine gave it up; it may still land in the buffer
                self._stats.add(timeouts=1)
                raise ConnectorTimeoutError(f"{what} did not finish within {limit:.1f} s")
            self._stats.add(errors=1)
            raise ConnectorError(
                f"{what} failed (code {code}): the sending stage has exited, or has released the value"
            )
        # A shorter deadline than the engine's: submitted, then polled here, the deadline checked between.
        batch = self.engine.batch_transfer_async_read(
            remote.agent, [buffer.data_ptr()], [remote.addr], [handle.nbytes]
        )
        if batch in SUBMIT_FAILED:
            self._stats.add(errors=1)
            raise ConnectorError(
                f"{what} failed: the transfer engine could not submit it (the sending stage has exited?)"
            )
        status = self._wait_for(batch, time.monotonic() + limit)
        if status in (PENDING, ENGINE_TIMEOUT):
            self._stats.add(timeouts=1)
            raise ConnectorTimeoutError(f"{what} did not finish within {limit:.1f} s")
        if status != COMPLETED:
            self._stats.add(errors=1)
            raise ConnectorError(
                f"{what} failed (status {status}): the sending stage has exited, or has released the value"
            )

    def _wait_for(self, batch: int, deadline: float) -> int:
        """The READ's final status, or PENDING at the deadline (then the engine may still write into its
        buffer, which the caller never reuses). Each poll releases the GIL; after ``POLL_SPIN_S`` of
        spinning, polls are spaced out so that a slow transfer does not take a core from its peers."""
        check = self.engine.transfer_check_status
        start = time.monotonic()
        pause = 0.0
        while (status := check(batch)) == PENDING:
            now = time.monotonic()
            if now > deadline:
                return PENDING
            if now - start > POLL_SPIN_S:
                pause = min(POLL_PAUSE_MAX_S, max(pause * 2, POLL_PAUSE_MIN_S))
                time.sleep(pause)
        return status

    def _notify(self, side_channel: bytes, message: bytes) -> None:
        """Tell an owner (fire and forget: a lost message is made good by the value's lease)."""
        address = side_channel.decode()
        what = "telling a Mooncake sender that a value was read (its lease frees it)"
        with best_effort(what, logger), self._lock:
            if self._closed:
                return
            sender = self._senders.get(address)
            if sender is None:
                sender = self._senders[address] = self._zmq.socket(zmq.PUSH)
                sender.setsockopt(zmq.LINGER, 1000)
                sender.setsockopt(zmq.SNDHWM, 1 << 16)
                sender.connect(address)
            sender.send(message, zmq.NOBLOCK)

    def _acknowledge(self, handle: ConnectorHandle, remote: RemoteLocation) -> None:
        self._notify(remote.metadata, ACK + handle.key.encode())

    def _send_release(self, handle: ConnectorHandle, remote: RemoteLocation) -> None:
        self._notify(remote.metadata, RELEASE + handle.key.encode())

    # --- lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            keys = list(self._owned)
            senders, self._senders = self._senders, {}
        self._stop.set()
        self._listener.join(5)
        with self._lock:
            regions, self._regions = self._regions, {}
            self._owned.clear()
        for address, _ in regions:
            with best_effort("deregistering Mooncake values at close", logger):
                self._unregister(address)
        self._pool.close()
        for sender in senders.values():
            sender.close()
        self._acks.close(0)
        self._zmq.term()
        if keys:
            logger.debug("%s: released %d uncollected value(s) at close", self.name, len(keys))
