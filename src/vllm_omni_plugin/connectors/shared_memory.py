"""Tensors and bytes between processes on one host, through files in ``/dev/shm``.

One value is one segment: a tmpfs file named ``vllm_omni_<owner pid>_<random>``. ``put`` creates it
and writes the value into it with ``pwrite`` (one copy, no pickle); ``get`` reads it with ``preadv``
straight into the returned tensor's memory (one copy) and unlinks it. We manage the files ourselves
rather than through ``multiprocessing.shared_memory``, whose resource tracker warns about (and unlinks
again) segments that one process creates and another unlinks. ``pwrite``/``preadv`` beat a mapped
``memcpy`` here: they skip the per-page faults of a fresh mapping, and the data ends up in one copy.

Nothing leaks when a stage dies:

* receiver crashed (or never came): the owner frees segments not collected within their lease
  (``extra: {lease_timeout_s: ...}``, default 300 s); a later ``get`` raises
  :class:`ConnectorTimeoutError` naming the handle;
* owner exiting: ``close()`` (also run at interpreter exit, and when the connector is collected) frees
  what it still owns;
* owner crashed: :func:`sweep_orphaned_segments` removes segments whose owner pid is gone; every new
  connector runs it. Pids are compared within this host's pid namespace, so processes that share
  ``/dev/shm`` must share the pid namespace too (the usual case: one container or none).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Literal

import torch

from vllm_omni_plugin.connectors.base import (
    ConnectorError,
    ConnectorHandle,
    ConnectorHealth,
    ConnectorTimeoutError,
    OmniConnector,
    Value,
    _Stats,
    dtype_from_name,
    dtype_name,
)
from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

SEGMENT_PREFIX = "vllm_omni_"
DEFAULT_SHM_DIR = "/dev/shm"
DEFAULT_LEASE_TIMEOUT_S = 300.0

_SEGMENT_NAME = re.compile(r"^vllm_omni_(\d+)_[0-9a-f]{16}$")
"""Names this module creates; a handle is external input, so its key must match before we touch a file."""
_OWNER_PID = re.compile(r"^vllm_omni_(\d+)_")
_MAX_IO = 1 << 30
"""Bytes per read/write call: Linux moves at most ~2 GiB per call."""
_KNOWN_EXTRA = ("lease_timeout_s", "shm_dir")


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process; a zombie (killed, not yet reaped) counts as dead."""
    if pid <= 0:
        return True  # not a process id we could have written; leave such files alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust kill(0)
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])


def sweep_orphaned_segments(shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> list[str]:
    """Remove ``vllm_omni_*`` segments whose owner process no longer exists; return their names.

    This is the cleanup for a sender that crashed (SIGKILL, OOM) with segments nobody collected.
    Segments of other users are left alone (``/dev/shm`` is sticky, we could not unlink them anyway).
    """
    removed: list[str] = []
    dead: set[int] = set()
    verdicts: dict[int, bool] = {}
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = _OWNER_PID.match(entry.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid():
            continue
        if pid not in verdicts:
            verdicts[pid] = _pid_alive(pid)
        if verdicts[pid]:
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue  # another sweeper or the receiver got there first
        except PermissionError:
            logger.debug("cannot remove orphaned segment %s (another user's)", entry.path)
            continue
        removed.append(entry.name)
        dead.add(pid)
    if removed:
        logger.warning(
            "removed %d shared-memory segment(s) left by exited process(es) %s", len(removed), sorted(dead)
        )
    return removed


class _Segments:
    """The segments one connector owns, kept apart from the connector so that the reaper thread and
    the exit-time finalizer can run without keeping the connector alive."""

    def __init__(self, name: str, shm_dir: str, lease_timeout_s: float, stats: _Stats) -> None:
        self.name = name
        self.shm_dir = shm_dir
        self.lease_timeout_s = lease_timeout_s
        self.stats = stats
        self.lock = threading.Lock()
        self.owned: dict[str, float] = {}
        """Segment name -> monotonic deadline of its lease (inf without a lease)."""
        self.pid = os.getpid()
        self.closed = False
        self.stop = threading.Event()
        self.reaper: threading.Thread | None = None

    def add(self, name: str) -> None:
        deadline = time.monotonic() + self.lease_timeout_s if self.lease_timeout_s > 0 else float("inf")
        with self.lock:
            if self.closed:
                raise ConnectorError(f"connector {self.name!r} is closed")
            self.owned[name] = deadline
            if self.reaper is None and self.lease_timeout_s > 0:
                self.reaper = threading.Thread(
                    target=self._reap_loop, name="vllm-omni-shm-reaper", daemon=True
                )
                self.reaper.start()

    def forget(self, name: str) -> None:
        with self.lock:
            self.owned.pop(name, None)

    def count(self) -> int:
        with self.lock:
            return len(self.owned)

    def reap(self) -> list[str]:
        """Forget segments a receiver has freed and free those whose lease ran out; return the latter."""
        now = time.monotonic()
        with self.lock:
            if self.pid != os.getpid():
                return []
            snapshot = list(self.owned.items())
        collected: list[str] = []
        expired: list[str] = []
        for name, deadline in snapshot:
            path = os.path.join(self.shm_dir, name)
            if now >= deadline:
                try:
                    os.unlink(path)
                    expired.append(name)
                except FileNotFoundError:
                    collected.append(name)  # the receiver was just in time
            elif not os.path.exists(path):
                collected.append(name)
        if collected or expired:
            with self.lock:
                for name in collected + expired:
                    self.owned.pop(name, None)
        if expired:
            self.stats.add(timeouts=len(expired))
            logger.warning(
                "freed %d shared-memory segment(s) not collected within the %.0f s lease: %s",
                len(expired),
                self.lease_timeout_s,
                ", ".join(expired[:8]) + (" ..." if len(expired) > 8 else ""),
            )
        return expired

    def _reap_loop(self) -> None:
        interval = min(max(self.lease_timeout_s / 4, 0.02), 10.0)
        while not self.stop.wait(interval):
            try:
                self.reap()
            except Exception:  # keep reaping; one bad stat must not end the lease guarantee
                logger.exception("shared-memory lease reaper failed")

    def release_all(self) -> int:
        """Free every owned segment (close, exit, garbage collection); a forked child frees nothing."""
        with self.lock:
            self.closed = True
            names = list(self.owned)
            self.owned.clear()
            mine = self.pid == os.getpid()
        self.stop.set()
        if not mine:
            return 0
        freed = 0
        for name in names:
            try:
                os.unlink(os.path.join(self.shm_dir, name))
                freed += 1
            except FileNotFoundError:
                pass
        return freed

    def after_fork_in_child(self) -> None:
        """A forked child owns none of its parent's segments, and must not wait on a lock held at fork."""
        self.lock = threading.Lock()
        self.owned = {}
        self.pid = os.getpid()
        self.stop = threading.Event()
        self.reaper = None


_LIVE: weakref.WeakSet[SharedMemoryConnector] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for connector in list(_LIVE):
        connector._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _write_all(fd: int, data: memoryview) -> None:
    offset = 0
    while offset < len(data):
        offset += os.pwrite(fd, data[offset : offset + _MAX_IO], offset)


def _read_all(fd: int, out: memoryview, name: str) -> None:
    offset = 0
    while offset < len(out):
        got = os.preadv(fd, [out[offset : offset + _MAX_IO]], offset)
        if got == 0:
            raise ConnectorError(f"segment {name} is shorter than its handle says ({offset} < {len(out)})")
        offset += got


def _as_bytes_view(value: Value) -> tuple[memoryview, torch.Tensor | None]:
    """A flat byte view of ``value``, plus the CPU tensor that must stay alive while it is used."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise TypeError(f"cannot put a {value.layout} tensor; only dense (strided) tensors")
        cpu = value.detach()
        if cpu.device.type != "cpu":
            cpu = cpu.to("cpu")
        cpu = cpu.resolve_conj().resolve_neg().contiguous()
        return memoryview(cpu.reshape(-1).view(torch.uint8).numpy()), cpu
    view = memoryview(value)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B"), None


class SharedMemoryConnector(OmniConnector):
    """Stage outputs between processes on one host via ``/dev/shm``; see the module docstring.

    ``extra``: ``lease_timeout_s`` (float, default 300; 0 keeps segments until ``close``) and
    ``shm_dir`` (default ``/dev/shm``).
    """

    def __init__(self, name: str, extra: dict[str, Any] | None = None) -> None:
        super().__init__(name, extra)
        unknown = sorted(set(self.extra) - set(_KNOWN_EXTRA))
        if unknown:
            logger.warning(
                "connector %s: ignoring unknown SharedMemoryConnector option(s) %s (known: %s)",
                name,
                ", ".join(unknown),
                ", ".join(_KNOWN_EXTRA),
            )
        lease = float(self.extra.get("lease_timeout_s", DEFAULT_LEASE_TIMEOUT_S))
        if lease < 0:
            raise ValueError(f"connector {name!r}: lease_timeout_s must be >= 0, got {lease}")
        self.lease_timeout_s = lease
        # Paths are plain strings: pathlib costs ~10 us per put and get, a third of a small transfer.
        self.shm_dir = str(self.extra.get("shm_dir", DEFAULT_SHM_DIR))
        if not os.path.isdir(self.shm_dir):
            raise ValueError(f"connector {name!r}: shared-memory directory {self.shm_dir} does not exist")
        sweep_orphaned_segments(self.shm_dir)
        self._segments = _Segments(name, self.shm_dir, lease, self._stats)
        # weakref.finalize also runs at interpreter exit (it registers with atexit itself), and does so
        # without keeping the connector alive.
        self._finalizer = weakref.finalize(self, self._segments.release_all)
        _LIVE.add(self)

    # -- OmniConnector ----------------------------------------------------------------------------------

    def put(self, value: Value) -> ConnectorHandle:
        if self._segments.closed:
            raise ConnectorError(f"connector {self.name!r} is closed")
        try:
            data, keepalive = _as_bytes_view(value)
        except (TypeError, ValueError) as exc:
            self._stats.add(errors=1)
            raise TypeError(f"{self.name}: cannot put {type(value).__name__}: {exc}") from exc
        kind: Literal["tensor", "bytes"] = "tensor" if keepalive is not None else "bytes"
        pid = os.getpid()
        segment = f"{SEGMENT_PREFIX}{pid}_{secrets.token_hex(8)}"
        path = os.path.join(self.shm_dir, segment)
        created_at = time.time()
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            _unlink_quietly(path)
            self._stats.add(errors=1)
            raise ConnectorError(
                f"{self.name}: cannot store {data.nbytes} bytes in {path}: {exc}"
                + (f" ({self.shm_dir} is full or too small)" if exc.errno == errno.ENOSPC else "")
            ) from exc
        # Registered once complete: the reaper takes a registered segment that is missing for collected.
        # A crash before this line leaves a file for sweep_orphaned_segments.
        try:
            self._segments.add(segment)
        except ConnectorError:
            _unlink_quietly(path)  # closed while we wrote
            raise
        self._stats.add(puts=1, bytes_put=data.nbytes)
        tensor = value if isinstance(value, torch.Tensor) else None
        return ConnectorHandle(
            connector=self.name,
            key=segment,
            kind=kind,
            nbytes=data.nbytes,
            dtype=dtype_name(tensor.dtype) if tensor is not None else None,
            shape=tuple(tensor.shape) if tensor is not None else None,
            owner_pid=pid,
            created_at=created_at,
            lease_timeout_s=self.lease_timeout_s,
        )

    def get(self, handle: ConnectorHandle, timeout: float | None = None) -> torch.Tensor | bytes:
        """Copy the value out and free its segment.

        ``timeout`` is accepted for the interface: a segment is complete before its handle exists, so
        there is nothing to wait for.
        """
        path = self._path_of(handle)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise self._gone(handle) from None
        except OSError as exc:
            self._stats.add(errors=1)
            raise ConnectorError(f"{self.name}: cannot open segment {handle.key}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != handle.nbytes:
                raise ConnectorError(
                    f"{self.name}: segment {handle.key} holds {size} bytes, its handle says {handle.nbytes}"
                )
            value = self._read(fd, handle)
        except ConnectorError:
            self._stats.add(errors=1)
            raise
        except (OSError, RuntimeError, ValueError) as exc:
            self._stats.add(errors=1)
            raise ConnectorError(f"{self.name}: cannot read segment {handle.key}: {exc}") from exc
        finally:
            os.close(fd)
        # The owner's lease may have run out while we read; we hold the data already, so that is fine.
        _unlink_quietly(path)
        self._segments.forget(handle.key)
        self._stats.add(gets=1, bytes_got=handle.nbytes)
        return value

    def cleanup(self, handle: ConnectorHandle) -> None:
        _unlink_quietly(self._path_of(handle))
        self._segments.forget(handle.key)

    def close(self) -> None:
        self._finalizer()

    def _outstanding(self) -> int:
        return self._segments.count()

    def health(self) -> ConnectorHealth:
        # Receivers in other processes free segments without telling us: look before counting.
        self._segments.reap()
        return super().health()

    # -- helpers ---------------------------------------------------------------------------------------

    def reap(self) -> list[str]:
        """Free segments whose lease ran out now (the background reaper does this periodically)."""
        return self._segments.reap()

    def _after_fork_in_child(self) -> None:
        self._segments.after_fork_in_child()  # in place: the finalizer now releases the child's own
        self._stats.lock = threading.Lock()

    def _path_of(self, handle: ConnectorHandle) -> str:
        if _SEGMENT_NAME.match(handle.key) is None:
            self._stats.add(errors=1)
            raise ConnectorError(
                f"{self.name}: handle key {handle.key!r} is not a shared-memory segment name "
                f"(handle of connector {handle.connector!r})"
            )
        return os.path.join(self.shm_dir, handle.key)

    def _gone(self, handle: ConnectorHandle) -> ConnectorError:
        """Why a segment is missing, as far as the handle lets us tell."""
        age = time.time() - handle.created_at
        if handle.lease_timeout_s > 0 and age >= handle.lease_timeout_s:
            self._stats.add(timeouts=1)
            return ConnectorTimeoutError(
                f"{self.name}: segment {handle.key} was not collected within its lease of "
                f"{handle.lease_timeout_s:g} s (put {age:.1f} s ago); its owner (pid {handle.owner_pid}) "
                "freed it"
            )
        self._stats.add(errors=1)
        if handle.owner_pid and not _pid_alive(handle.owner_pid):
            return ConnectorError(
                f"{self.name}: segment {handle.key} is gone: its owner (pid {handle.owner_pid}) exited"
            )
        return ConnectorError(
            f"{self.name}: segment {handle.key} does not exist: already collected by a get, or released "
            f"by cleanup/close of its owner (pid {handle.owner_pid})"
        )

    def _read(self, fd: int, handle: ConnectorHandle) -> torch.Tensor | bytes:
        if handle.kind == "bytes":
            if handle.nbytes <= _MAX_IO:
                data = os.pread(fd, handle.nbytes, 0)
                if len(data) != handle.nbytes:
                    raise ConnectorError(f"{self.name}: segment {handle.key} is shorter than its handle says")
                return data
            buf = bytearray(handle.nbytes)
            _read_all(fd, memoryview(buf), handle.key)
            return bytes(buf)
        if handle.kind != "tensor" or handle.dtype is None or handle.shape is None:
            raise ConnectorError(f"{self.name}: handle {handle.key} is malformed (kind {handle.kind!r})")
        dtype = dtype_from_name(handle.dtype)
        shape = tuple(handle.shape)
        numel = 1
        for dim in shape:
            numel *= dim
        if numel * dtype.itemsize != handle.nbytes:
            raise ConnectorError(
                f"{self.name}: handle {handle.key}: {handle.nbytes} bytes cannot hold "
                f"{handle.dtype}{list(shape)}"
            )
        out = torch.empty(shape, dtype=dtype)
        if handle.nbytes:
            _read_all(fd, memoryview(out.reshape(-1).view(torch.uint8).numpy()), handle.key)
        return out


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
