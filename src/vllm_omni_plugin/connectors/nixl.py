"""Tensors and bytes between stage processes, on one host or across hosts, through NIXL (UCX underneath).

One NIXL agent per connector object, i.e. per stage process. The receiver pulls:

* ``put`` registers the caller's tensor with the agent where it lies (no copy; DRAM here, VRAM for a
  CUDA tensor) and returns a handle carrying the agent's metadata for that registration, connection
  info included. The handle travels in the stage's control message, so the metadata exchange needs no
  side channel and no round trip.
* ``get`` adds the owner's agent from the handle, READs the value into a buffer of its own receive
  pool (registered once, reused, so its pages stay warm) and returns a tensor view of that buffer; the
  buffer goes back to the pool when the returned tensor is garbage collected. The READ carries an
  ``ack`` notification: the owner releases (deregisters and drops) its value when the ack arrives.
* Nothing leaks: an uncollected value is released when its lease runs out (``lease_timeout_s``); a
  receiver refuses handles whose lease is about to end (the owner may have reused that memory, and a
  READ of released DRAM is not an error to every transport). ``cleanup`` on the receiving side sends a
  ``release`` notification to the owner. ``close()`` releases everything at shutdown.

Deploy config: ``connectors: {x: {name: NixlConnector, extra: {...}}}`` with ``backends`` (default
``[UCX]``), ``transfer_timeout_s`` (30), ``lease_timeout_s`` (300), ``recv_pool_bytes`` (256 MiB;
values that do not fit are read into one-off buffers) and ``num_threads`` (backend worker threads).
UCX itself is configured the usual way, through ``UCX_*`` environment variables (e.g. ``UCX_TLS``).
"""

from __future__ import annotations

import functools
import importlib
import os
import secrets
import socket
import threading
import time
import weakref
from collections import OrderedDict
from types import ModuleType
from typing import Annotated, Any

import msgspec
import torch
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

logger = get_logger(__name__)

NIXL_API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
"""Where the ``nixl`` Python API lives: the ``nixl`` meta package, or one CUDA build of it alone."""


class NixlSettings(ConnectorSettings, frozen=True, kw_only=True):
    """``extra`` of a ``NixlConnector``."""

    backends: Annotated[list[str], Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["UCX"])
    """NIXL backends to create in the agent (every one must be available)."""
    transfer_timeout_s: Annotated[float, Meta(ge=1e-3)] = 30.0
    lease_timeout_s: Annotated[float, Meta(ge=0)] = 300.0
    """Seconds the owner keeps an uncollected value; 0: until it closes."""
    recv_pool_bytes: Annotated[int, Meta(ge=0)] = 256 << 20
    num_threads: Annotated[int, Meta(ge=0)] = 0
    """Backend worker threads (0: NIXL's default)."""
    progress_thread: bool = False


POLL_INTERVAL_S = (5e-5, 0.002)
"""How often the owner polls NIXL while values are outstanding: often right after a put or an ack,
backing off to the slower pace while nothing happens. The polls also drive UCX's progress, which
READs through transports that emulate them with active messages (e.g. TCP) wait for."""
SPIN_S = (2e-4, 0.005)
"""How long a receiver polls its READ without yielding to other threads, then without pausing."""
NOTIFY_LINGER_S = 2.0
"""How long an agent keeps driving UCX's progress after it sent a notification (a READ's ack, a
release): NIXL hands the message to UCX and forgets it, and over TCP what the socket did not take at once
leaves only with later progress. An agent that owns nothing would otherwise keep it until its next
transfer, or lose it at close."""
IDLE_REGIONS = 64
"""Released registrations an owner keeps for reuse."""
LOADED_METADATA = 4096
ACK, RELEASE = b"ack:", b"release:"


UCX_MODULES_ENV = "UCX_MODULES"
NO_EFA_MODULE = "^efa"


@functools.cache
def bundled_ucx_needs_system_verbs() -> bool:
    """Whether the installed NIXL wheel bundles its own ``libibverbs`` and a UCX EFA module
    (``libuct_ib_efa``) that links the system's ``libefa.so.1``, which it does not bundle.

    Where the system has ``libefa`` (Debian's ``ibverbs-providers``, which ``libibverbs1`` brings), loading
    that module brings the system's ``libibverbs`` and ``libnl-route-3`` beside the wheel's own copies;
    both copies' destructors then run at exit and the second one segfaults in ``rtnl_tc_unregister``
    (exit status 139 after every clean stop)."""
    from importlib import metadata

    for dist in ("nixl-cu12", "nixl-cu13", "nixl"):
        try:
            files = metadata.files(dist) or []
        except metadata.PackageNotFoundError:
            continue
        names = [f.name for f in files if ".libs/" in str(f)]
        own_verbs = any(n.startswith("libibverbs-") for n in names)
        efa_module = any(n.startswith("libuct_ib_efa.so") for n in names)
        bundled_efa = any(n.startswith("libefa-") for n in names)
        if own_verbs and efa_module and not bundled_efa:
            return True
    return False


def _keep_one_verbs_library() -> None:
    """Before NIXL (and UCX under it) first loads in this process: leave out UCX's EFA module where it
    would load a second ``libibverbs`` (:func:`bundled_ucx_needs_system_verbs`); every other transport,
    InfiniBand's included, loads as before. A ``UCX_MODULES`` of the user's own is left as it is."""
    if UCX_MODULES_ENV in os.environ or not bundled_ucx_needs_system_verbs():
        return
    os.environ[UCX_MODULES_ENV] = NO_EFA_MODULE
    logger.info(
        "%s=%s: the NIXL wheel's UCX EFA module would load the system's libibverbs beside the wheel's own "
        "(a crash at exit); set %s yourself to load it",
        UCX_MODULES_ENV,
        NO_EFA_MODULE,
        UCX_MODULES_ENV,
    )


def load_nixl_api() -> ModuleType:
    _keep_one_verbs_library()
    errors = []
    for name in NIXL_API_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError(
        "NixlConnector needs NIXL: pip install 'vllm-omni-plugin[nixl]' (or the nixl-cu12 / nixl-cu13 "
        f"package that matches your CUDA); tried {'; '.join(errors)}"
    )


class NixlConnector(PullingConnector):
    """See the module docstring. Thread-safe; one agent per connector object."""

    Settings = NixlSettings
    transport = "NIXL"

    device_memory = True  # NIXL registers VRAM

    def __init__(self, name: str, extra: dict[str, Any] | None = None) -> None:
        super().__init__(name, extra)
        settings: NixlSettings = self.settings
        self.backends = list(settings.backends)
        self.transfer_timeout_s = settings.transfer_timeout_s
        api = load_nixl_api()
        self.agent_name = f"{name}@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.endpoint = self.agent_name
        config = api.nixl_agent_config(
            backends=self.backends,
            num_threads=settings.num_threads,
            # NIXL's progress thread polls without pausing: a core per agent. Our ack poller and the
            # receiver's wait for its READ drive UCX's progress instead.
            enable_prog_thread=settings.progress_thread,
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            self.agent = api.nixl_agent(self.agent_name, config)
        except Exception as exc:
            raise ConnectorError(
                f"connector {name!r}: could not create a NIXL agent with backends {self.backends}: "
                f"{type(exc).__name__}: {exc} (check the UCX_* environment, e.g. UCX_TLS)"
            ) from exc
        missing = [b for b in self.backends if b not in self.agent.backends]
        if missing:
            raise ConnectorError(
                f"connector {name!r}: NIXL backend(s) {missing} are not available here "
                f"(NIXL plugins found: {', '.join(self.agent.plugin_list) or 'none'})"
            )
        self._regions: dict[tuple[int, int, int], list[Any]] = {}
        """(address, bytes, device) -> [registration, values using it, metadata]: a tensor put twice
        is registered once."""
        self._idle: OrderedDict[tuple[int, int, int], list[Any]] = OrderedDict()
        """Registrations no value uses any more, oldest first (see ``_register``)."""
        self._loaded: OrderedDict[bytes, str] = OrderedDict()
        """Remote metadata this agent has loaded -> the agent it names (receivers skip reloading it)."""
        self._pool = ReceivePool(
            self.agent.register_memory, self.agent.deregister_memory, settings.recv_pool_bytes, self.transport
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._notified_at = -NOTIFY_LINGER_S
        """When this agent last sent a notification (monotonic)."""
        self._reaper = threading.Thread(target=self._reap_loop, name=f"nixl-{name}-acks", daemon=True)
        self._reaper.start()
        self._finalizer = weakref.finalize(self, NixlConnector._stop_reaper, self._stop, self._wake)
        logger.debug("connector %s: NIXL agent %s (%s)", name, self.agent_name, self.backends)

    # --- owner side ---------------------------------------------------------------------------------

    def _expose(
        self, tensor: torch.Tensor, nbytes: int
    ) -> tuple[torch.Tensor, tuple[int, ...], RemoteLocation]:
        device_id = max(tensor.get_device(), 0)
        mem_type = "VRAM" if tensor.is_cuda else "DRAM"
        region = (tensor.data_ptr(), nbytes, device_id)
        metadata = self._register(region, mem_type) if nbytes else b""
        remote = RemoteLocation(
            agent=self.agent_name, metadata=metadata, addr=region[0], device_id=device_id, mem_type=mem_type
        )
        return tensor, region, remote

    def _after_put(self) -> None:
        self._wake.set()

    def _register(self, region: tuple[int, int, int], mem_type: str) -> bytes:
        """Register ``region`` (once) and return the metadata a receiver needs; lock held.

        Regions whose values were released stay registered for a while (``_idle``): a stage that puts
        tensors from recycled memory then sends the same metadata, which receivers have loaded already.
        The region is passed as a descriptor, not as the tensor: NIXL cannot describe a 0-d tensor.
        """
        entry = self._regions.get(region)
        if entry is None:
            entry = self._idle.pop(region, None)
            if entry is None:
                entry = [self._register_region(region, mem_type), 0, b""]
                entry[2] = self.agent.get_partial_agent_metadata(entry[0], True, self.backends)
            self._regions[region] = entry
        entry[1] += 1
        return entry[2]

    def _register_region(self, region: tuple[int, int, int], mem_type: str) -> Any:
        try:
            return self.agent.register_memory([(*region, "")], mem_type)
        except Exception:  # may overlap an idle registration of memory since reused: drop those, retry
            start, end = region[0], region[0] + region[1]
            for other in [r for r in self._idle if r[0] < end and start < r[0] + r[1]]:
                with best_effort("deregistering an idle NIXL region that overlaps a new one", logger):
                    self.agent.deregister_memory(self._idle.pop(other)[0])
            return self.agent.register_memory([(*region, "")], mem_type)

    def _drop_region(self, owned: Owned) -> None:
        entry = self._regions.get(owned.region)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                self._idle[owned.region] = self._regions.pop(owned.region)
                while len(self._idle) > IDLE_REGIONS:
                    with best_effort("deregistering an idle NIXL region", logger):
                        self.agent.deregister_memory(self._idle.popitem(last=False)[1][0])

    def _reap_loop(self) -> None:
        fastest, slowest = POLL_INTERVAL_S
        interval, last_activity = fastest, time.monotonic()
        while not self._stop.is_set():
            if not self._outstanding() and time.monotonic() - self._notified_at > NOTIFY_LINGER_S:
                self._wake.wait(1.0)
                self._wake.clear()
                interval, last_activity = fastest, time.monotonic()
                continue
            busy = self._wake.is_set()
            self._wake.clear()
            try:
                busy = self._reap() or busy
            except Exception:  # keep releasing; one failed poll must not end the lease guarantee
                logger.exception("%s: polling NIXL notifications failed", self.name)
            now = time.monotonic()
            if busy:
                interval, last_activity = fastest, now
            else:
                interval = min(interval * 2, slowest)
            # Right after a put or an ack a READ is likely under way: poll without pausing for a moment.
            time.sleep(0 if now - last_activity < SPIN_S[1] else interval)

    def _reap(self) -> bool:
        """Handle acknowledgements, release requests and expired leases; whether anything came."""
        with self._lock:
            if self._closed:
                return False
            notifications = self.agent.get_new_notifs()
        for messages in notifications.values():
            for message in messages:
                if message.startswith(ACK):
                    self._release(message[len(ACK) :].decode(errors="replace"), acked=True)
                elif message.startswith(RELEASE):
                    self._release(message[len(RELEASE) :].decode(errors="replace"))
        self._expire_leases()
        return bool(notifications)

    # --- receiver side -------------------------------------------------------------------------------

    def _read(
        self, handle: ConnectorHandle, remote: RemoteLocation, buffer: torch.Tensor, timeout: float | None
    ) -> None:
        limit = self.transfer_timeout_s if timeout is None else min(timeout, self.transfer_timeout_s)
        what = f"{self.name}: reading {handle.key!r} ({handle.nbytes} bytes) from {remote.agent}"
        transfer = None
        try:
            with self._lock:
                peer = self._load_remote(remote.metadata)
                local = self.agent.get_xfer_descs([(buffer.data_ptr(), handle.nbytes, 0)], "DRAM")
                far = self.agent.get_xfer_descs(
                    [(remote.addr, handle.nbytes, remote.device_id)], remote.mem_type
                )
                transfer = self.agent.initialize_xfer("READ", local, far, peer, ACK + handle.key.encode())
                state = self.agent.transfer(transfer)
            start = time.monotonic()
            while state == "PROC":
                now = time.monotonic()
                if now - start > limit:
                    self._stats.add(timeouts=1)
                    raise ConnectorTimeoutError(f"{what} did not finish within {limit:.1f} s")
                # Most READs finish within milliseconds: poll (this drives UCX's progress) while
                # letting other threads run, then back off so a slow transfer does not take a core.
                elapsed = now - start
                if elapsed > SPIN_S[0]:
                    time.sleep(0 if elapsed < SPIN_S[1] else min(elapsed / 10, 1e-3))
                state = self.agent.check_xfer_state(transfer)
            if state != "DONE":
                raise ConnectorError(f"{what} failed (NIXL state {state})")
            self._notified()  # the READ's ack
        except ConnectorTimeoutError:
            raise
        except ConnectorError:
            self._stats.add(errors=1)
            raise
        except Exception as exc:  # nixl raises its own error types (e.g. the owner has gone away)
            self._stats.add(errors=1)
            gone = "DISCONNECT" in f"{type(exc).__name__} {exc}".upper()
            raise ConnectorError(
                f"{what} failed: {type(exc).__name__}: {exc}"
                + (" (the sending stage has exited)" if gone else "")
            ) from exc
        finally:
            if transfer is not None:
                with best_effort("releasing a NIXL transfer handle", logger):
                    self.agent.release_xfer_handle(transfer)

    def _load_remote(self, metadata: bytes) -> str:
        """Add the remote agent a handle's metadata describes, unless exactly this was loaded; lock held."""
        name = self._loaded.get(metadata)
        if name is None:
            name = _agent_name(self.agent.add_remote_agent(metadata))
            self._loaded[metadata] = name
            if len(self._loaded) > LOADED_METADATA:
                self._loaded.popitem(last=False)
        else:
            self._loaded.move_to_end(metadata)
        return name

    def _send_release(self, handle: ConnectorHandle, remote: RemoteLocation) -> None:
        with best_effort("asking a NIXL sender to release a value (its lease frees it)", logger), self._lock:
            peer = self._load_remote(remote.metadata)
            self.agent.send_notif(peer, RELEASE + handle.key.encode())
        self._notified()

    def _notified(self) -> None:
        """A notification went to UCX: poll until it has surely left (``NOTIFY_LINGER_S``)."""
        self._notified_at = time.monotonic()
        self._wake.set()

    # --- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            keys = list(self._owned)
        self._stop_reaper(self._stop, self._wake)
        self._reaper.join(5)
        with self._lock:
            regions, self._regions = {**self._idle, **self._regions}, {}
            self._idle.clear()
            self._owned.clear()
        for registration, *_ in regions.values():
            with best_effort("deregistering NIXL regions at close", logger):
                self.agent.deregister_memory(registration)
        self._pool.close()
        if keys:
            logger.debug("%s: released %d uncollected value(s) at close", self.name, len(keys))

    @staticmethod
    def _stop_reaper(stop: threading.Event, wake: threading.Event) -> None:
        stop.set()
        wake.set()


def _agent_name(peer: Any) -> str:
    return peer.decode() if isinstance(peer, bytes) else str(peer)
