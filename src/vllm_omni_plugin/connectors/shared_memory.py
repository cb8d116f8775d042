"""Tensors and bytes between processes on one host, through files in ``/dev/shm``.

Values travel in segments, tmpfs files named ``vllm_omni_<owner pid>_...``. Fresh tmpfs pages are
expensive (allocating, zeroing and mapping a page costs about as much as copying it several times), so
a connector reuses its segments:

* **Pooled segments** (the common case). The sender keeps a pool of segments, each mapped once, so
  their pages stay allocated and mapped. ``put`` is one ``memcpy`` into a free segment of the value's
  size class (quarter-octave steps, at least 64 KiB) behind a one-page header: a state word (free,
  put or held, plus a generation number that the handle key carries), the reader's pid and the
  value's size. A receiver keeps its mapping of each segment it has read from; ``get`` claims the
  value (state put -> held, under ``flock``) and returns a zero-copy tensor **view** of the segment.
  The value then lives until that tensor, and every view of it, is garbage collected; a finalizer
  marks the segment free and the sender reuses it for a later value. A ``get`` result is safe to
  read and to keep as long as needed, but treat it as read-only: it is the sender's shared memory,
  refilled with a later value as soon as the tensor is gone (``clone()`` it for memory of your own).
  Byte strings are copied out, and their segment freed, at once. ``extra: {pool_bytes: ...}`` caps
  the pool's total segment capacity (default 256 MiB per connector, allocated as values need it and
  kept until ``close``; 0 disables pooling). Values larger than the cap, and values that find every
  segment of their size class put or held with no room for another, take the one-off path.
* **One-off segments.** ``put`` creates a file for one value and writes it with ``pwrite`` (one copy,
  no pickle); ``get`` reads it with ``preadv`` straight into a fresh tensor (one copy) and unlinks it.

We manage the files ourselves rather than through ``multiprocessing.shared_memory``, whose resource
tracker warns about (and unlinks again) segments that one process creates and another unlinks.

Nothing leaks when a stage dies:

* receiver crashed (or never came): the owner frees values not collected within their lease
  (``extra: {lease_timeout_s: ...}``, default 300 s); a later ``get`` raises
  :class:`ConnectorTimeoutError` naming the handle;
* receiver crashed while holding a view: the owner reclaims the pooled segment when it looks for a
  free one (the header records the reader's pid);
* owner exiting: ``close()`` (also run at interpreter exit, and when the connector is collected) frees
  what it still owns, its pool included; views a receiver still holds stay valid (their mapping
  outlives the file), and receivers drop their mappings of removed segments on a later ``get``;
* owner crashed: :func:`sweep_orphaned_segments` removes segments whose owner pid is gone; every new
  connector runs it. Pids are compared within this host's pid namespace, so processes that share
  ``/dev/shm`` must share the pid namespace too (the usual case: one container or none).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
from msgspec import Meta

from vllm_omni_plugin.connectors import shm_segment as seg
from vllm_omni_plugin.connectors.base import (
    ConnectorError,
    ConnectorHandle,
    ConnectorHealth,
    ConnectorSettings,
    ConnectorTimeoutError,
    OmniConnector,
    Value,
    _Stats,
    dtype_from_name,
    dtype_name,
)
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.processes import OUR_SEGMENT_PREFIX, segment_owner

logger = get_logger(__name__)

SEGMENT_PREFIX = OUR_SEGMENT_PREFIX
DEFAULT_SHM_DIR = "/dev/shm"
DEFAULT_LEASE_TIMEOUT_S = 300.0
DEFAULT_POOL_BYTES = 256 << 20

_SEGMENT_NAME = re.compile(r"^vllm_omni_(\d+)_[0-9a-f]{16}$")
"""One-off segment names; a handle is external input, so its key must match before we touch a file."""
_POOL_KEY = re.compile(r"^(vllm_omni_(\d+)_pool_[0-9a-f]{16})@(\d{1,18})$")
"""Keys of pooled values: the segment's file name, ``@``, the generation of the value in it."""
_MAX_IO = 1 << 30
"""Bytes per read/write call: Linux moves at most ~2 GiB per call."""
_MIN_CLASS = 64 << 10
_MAX_POOL_SEGMENTS = 256
_RECEIVER_MAPPINGS = 1024
"""Segments a receiver keeps mapped (each holds an fd); past that, the oldest mappings go first."""
_STALE_CHECK_S = 1.0


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

    This is the cleanup for a sender that crashed (SIGKILL, OOM) with segments nobody collected, or with
    its pool. Segments of other users are left alone (``/dev/shm`` is sticky, we could not unlink them
    anyway).
    """
    removed: list[str] = []
    dead: set[int] = set()
    verdicts: dict[int, bool] = {}
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return removed
    for entry in entries:
        pid = segment_owner(entry.name)
        if pid is None or pid == os.getpid():
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


def _size_class(nbytes: int) -> int:
    """Pool segment capacity for a value: quarter-octave steps (at most 25% slack), at least 64 KiB."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    step = 1 << max(nbytes.bit_length() - 3, 12)
    return -(-nbytes // step) * step


class _PoolSegment:
    """One reusable segment, as its owner sees it."""

    __slots__ = ("name", "path", "capacity", "mm", "data", "addr", "gen", "deadline", "writing", "last_used")

    def __init__(self, name: str, path: str, capacity: int, mm: mmap.mmap) -> None:
        self.name = name
        self.path = path
        self.capacity = capacity
        self.mm = mm
        self.data = np.frombuffer(mm, dtype=np.uint8, count=capacity, offset=seg.HEADER_BYTES)
        self.addr: int = self.data.ctypes.data
        self.gen = 0
        """Generation of the latest value put here."""
        self.deadline = float("inf")
        """Monotonic time the latest value's lease runs out."""
        self.writing = True
        """Claimed by a ``put`` that has not published its value yet."""
        self.last_used = time.monotonic()

    def state(self) -> int:
        """The segment's state word (see ``shm_segment``)."""
        return seg.read_state(self.mm)


def _create_pool_segment(shm_dir: str, capacity: int) -> _PoolSegment:
    name = f"{SEGMENT_PREFIX}{os.getpid()}_pool_{secrets.token_hex(8)}"
    path = os.path.join(shm_dir, name)
    return _PoolSegment(name, path, capacity, seg.create_segment(path, capacity))


class _Segments:
    """The segments one connector owns (one-off and pooled), kept apart from the connector so that the
    reaper thread and the exit-time finalizer can run without keeping the connector alive."""

    def __init__(
        self, name: str, shm_dir: str, lease_timeout_s: float, pool_bytes: int, stats: _Stats
    ) -> None:
        self.name = name
        self.shm_dir = shm_dir
        self.lease_timeout_s = lease_timeout_s
        self.pool_bytes = pool_bytes
        self.stats = stats
        self.lock = threading.Lock()
        self.owned: dict[str, float] = {}
        """One-off segment name -> monotonic deadline of its lease (inf without a lease)."""
        self.pool: dict[int, list[_PoolSegment]] = {}
        """Capacity -> the pool's segments of that size class."""
        self.pool_reserved = 0
        """Capacity of the pool's segments, plus of those being created."""
        self.pool_count = 0
        self.pool_failed = False
        """A segment could not be created (e.g. ``/dev/shm`` is full): warn once."""
        self.pid = os.getpid()
        self.closed = False
        self.stop = threading.Event()
        self.reaper: threading.Thread | None = None

    def deadline(self) -> float:
        return time.monotonic() + self.lease_timeout_s if self.lease_timeout_s > 0 else float("inf")

    def _start_reaper_locked(self) -> None:
        if self.reaper is None and self.lease_timeout_s > 0:
            self.reaper = threading.Thread(target=self._reap_loop, name="vllm-omni-shm-reaper", daemon=True)
            self.reaper.start()

    def add(self, name: str) -> None:
        deadline = self.deadline()
        with self.lock:
            if self.closed:
                raise ConnectorError(f"connector {self.name!r} is closed")
            self.owned[name] = deadline
            self._start_reaper_locked()

    def forget(self, name: str) -> None:
        with self.lock:
            self.owned.pop(name, None)

    def count(self) -> int:
        """Values put and not yet collected or released."""
        with self.lock:
            segments = [segment for group in self.pool.values() for segment in group]
            count = len(self.owned)
        return count + sum(seg.state_of(segment.state()) == seg.PUT for segment in segments)

    # -- the pool --------------------------------------------------------------------------------------

    def acquire(self, nbytes: int) -> _PoolSegment | None:
        """A pool segment for a value of ``nbytes``, claimed for writing; None: take the one-off path."""
        capacity = _size_class(nbytes)
        if nbytes == 0 or capacity > self.pool_bytes:
            return None
        victims: list[_PoolSegment] = []
        with self.lock:
            if self.closed:
                raise ConnectorError(f"connector {self.name!r} is closed")
            segment = self._find_free_locked(capacity)
            if segment is not None:
                segment.writing = True
                return segment
            if not self._make_room_locked(capacity, victims):
                self._drop(victims)
                return None
            self.pool_reserved += capacity
            self.pool_count += 1
        self._drop(victims)
        try:
            segment = _create_pool_segment(self.shm_dir, capacity)
        except OSError as exc:
            with self.lock:
                self.pool_reserved -= capacity
                self.pool_count -= 1
            logger.log(
                logging.DEBUG if self.pool_failed else logging.WARNING,
                "connector %s: cannot add a %d-byte segment to the shared-memory pool in %s (%s); "
                "taking the one-off path",
                self.name,
                capacity,
                self.shm_dir,
                exc,
            )
            self.pool_failed = True
            return None
        with self.lock:
            if self.closed:
                self.pool_reserved -= capacity
                self.pool_count -= 1
                closed = True
            else:
                self.pool.setdefault(capacity, []).append(segment)
                closed = False
        if closed:
            _unlink_quietly(segment.path)
            raise ConnectorError(f"connector {self.name!r} is closed")
        return segment

    def _find_free_locked(self, capacity: int) -> _PoolSegment | None:
        """A free segment of the value's size class, else of a larger one (up to twice the size);
        reclaims segments whose reader died holding them. Oldest first (the likeliest to be free again)."""
        held: list[_PoolSegment] = []
        classes = [capacity] if capacity in self.pool else []
        classes += sorted(c for c in self.pool if capacity < c <= 2 * capacity)
        for cap in classes:
            group = self.pool[cap]
            for segment in group:
                if segment.writing:
                    continue
                state = seg.state_of(segment.state())
                if state == seg.FREE:
                    group.remove(segment)
                    group.append(segment)
                    return segment
                if state == seg.HELD:
                    held.append(segment)
        verdicts: dict[int, bool] = {}
        for segment in held:
            if self._reclaim_if_reader_died(segment, verdicts):
                return segment
        return None

    def _reclaim_if_reader_died(self, segment: _PoolSegment, verdicts: dict[int, bool]) -> bool:
        held = segment.state()
        if seg.state_of(held) != seg.HELD:
            return False
        reader = seg.read_reader(segment.mm)
        if reader not in verdicts:
            verdicts[reader] = _pid_alive(reader)
        if verdicts[reader]:
            return False
        seg.reclaim(segment.mm, held)
        logger.warning(
            "connector %s: reclaimed shared-memory segment %s from reader pid %d, which exited holding it",
            self.name,
            segment.name,
            reader,
        )
        return True

    def _make_room_locked(self, capacity: int, victims: list[_PoolSegment]) -> bool:
        """Whether a new segment of ``capacity`` fits, evicting free segments (least recently used
        first) if that makes it fit; evicted ones are appended to ``victims`` (unlinked by the caller,
        outside the lock)."""

        def fits() -> bool:
            return self.pool_reserved + capacity <= self.pool_bytes and self.pool_count < _MAX_POOL_SEGMENTS

        if fits():
            return True
        free = sorted(
            (
                s
                for group in self.pool.values()
                for s in group
                if not s.writing and seg.state_of(s.state()) == seg.FREE
            ),
            key=lambda s: s.last_used,
        )
        if self.pool_reserved - sum(s.capacity for s in free) + capacity > self.pool_bytes:
            return False  # evicting every free segment would not make room: keep them
        for segment in free:
            self.pool[segment.capacity].remove(segment)
            if not self.pool[segment.capacity]:
                del self.pool[segment.capacity]
            self.pool_reserved -= segment.capacity
            self.pool_count -= 1
            victims.append(segment)
            if fits():
                return True
        return False

    @staticmethod
    def _drop(segments: list[_PoolSegment]) -> None:
        for segment in segments:
            _unlink_quietly(segment.path)  # receivers' mappings keep any views they hold valid

    def publish(self, segment: _PoolSegment, nbytes: int) -> int:
        """Make the value just written into ``segment`` collectable; returns its generation."""
        gen = segment.gen + 1
        segment.gen = gen
        segment.deadline = self.deadline()
        segment.last_used = time.monotonic()
        seg.publish(segment.mm, gen, nbytes)
        with self.lock:
            segment.writing = False
            closed = self.closed
            if not closed:
                self._start_reaper_locked()
        if closed:
            raise ConnectorError(f"connector {self.name!r} is closed")  # its file went with close()
        return gen

    def unclaim(self, segment: _PoolSegment) -> None:
        """Give back a segment a failed ``put`` claimed (its state is still free)."""
        with self.lock:
            segment.writing = False

    # -- leases, close, fork ---------------------------------------------------------------------------

    def reap(self) -> None:
        """Forget segments a receiver has freed, free those whose lease ran out (logged) and reclaim
        pooled segments whose reader died."""
        now = time.monotonic()
        with self.lock:
            if self.pid != os.getpid():
                return
            snapshot = list(self.owned.items())
            pooled = [s for group in self.pool.values() for s in group if not s.writing]
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
        for segment in pooled:
            state = segment.state()
            # A lease ends under flock, against a receiver's claim; a put only takes free segments.
            if seg.state_of(state) == seg.PUT and now >= segment.deadline:
                if seg.locked_transition(segment.path, state, seg.freed(state)):
                    expired.append(f"{segment.name}@{seg.generation_of(state)}")
        verdicts: dict[int, bool] = {}
        with self.lock:  # against a put reclaiming (and refilling) the same segment
            for segment in pooled:
                if not segment.writing:
                    self._reclaim_if_reader_died(segment, verdicts)
        if expired:
            self.stats.add(timeouts=len(expired))
            logger.warning(
                "freed %d shared-memory value(s) not collected within the %.0f s lease: %s",
                len(expired),
                self.lease_timeout_s,
                ", ".join(expired[:8]) + (" ..." if len(expired) > 8 else ""),
            )

    def _reap_loop(self) -> None:
        interval = min(max(self.lease_timeout_s / 4, 0.02), 10.0)
        while not self.stop.wait(interval):
            try:
                self.reap()
            except Exception:  # keep reaping; one bad stat must not end the lease guarantee
                logger.exception("shared-memory lease reaper failed")

    def release_all(self) -> None:
        """Free every owned segment (close, exit, garbage collection); a forked child frees nothing."""
        with self.lock:
            self.closed = True
            names = list(self.owned)
            self.owned.clear()
            pooled = [s for group in self.pool.values() for s in group]
            self.pool.clear()
            self.pool_reserved = self.pool_count = 0
            mine = self.pid == os.getpid()
        self.stop.set()
        if not mine:
            return
        for name in names:
            _unlink_quietly(os.path.join(self.shm_dir, name))
        # Unlinked, not unmapped: a put still writing keeps its segment alive, and so do receivers'
        # views; the memory goes with the last mapping.
        self._drop(pooled)

    def after_fork_in_child(self) -> None:
        """A forked child owns none of its parent's segments (nor its pool: writing there would
        overwrite the parent's values), and must not wait on a lock held at fork."""
        self.lock = threading.Lock()
        self.owned = {}
        self.pool = {}
        self.pool_reserved = self.pool_count = 0
        self.pid = os.getpid()
        self.stop = threading.Event()
        self.reaper = None


class _Mapping:
    """A receiver's mapping of one pooled segment (kept, so its page tables stay warm)."""

    __slots__ = ("fd", "mm", "capacity")

    def __init__(self, fd: int, mm: mmap.mmap, capacity: int) -> None:
        self.fd = fd
        self.mm = mm
        self.capacity = capacity


class _Mappings:
    """The pooled segments a receiver has mapped, oldest first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Also serialises claims: threads share a mapping's fd, and ``flock`` excludes other fds only."""
        self.entries: OrderedDict[str, _Mapping] = OrderedDict()
        self.checked = time.monotonic()

    def add(self, name: str, entry: _Mapping) -> None:
        """Keep a new mapping (unless another thread mapped the segment meanwhile); also forgets
        mappings of removed segments and, past the limit, the oldest ones."""
        with self.lock:
            if name in self.entries:
                os.close(entry.fd)
                return
            self.entries[name] = entry
            while len(self.entries) > _RECEIVER_MAPPINGS:
                os.close(self.entries.popitem(last=False)[1].fd)
        self.drop_stale()

    def drop_stale(self) -> None:
        """Forget mappings of segments their owner removed (so the memory can go once views are gone)."""
        with self.lock:
            self.checked = time.monotonic()
            for name, entry in list(self.entries.items()):
                try:
                    gone = os.fstat(entry.fd).st_nlink == 0
                except OSError:
                    gone = True
                if gone:
                    del self.entries[name]
                    os.close(entry.fd)

    def close_all(self) -> None:
        with self.lock:
            entries = list(self.entries.values())
            self.entries.clear()
        for entry in entries:
            os.close(entry.fd)  # the mappings stay while views of them exist

    def after_fork_in_child(self) -> None:
        """The inherited fds share their lock with the parent's: open our own from now on."""
        self.lock = threading.Lock()
        entries, self.entries = self.entries, OrderedDict()
        for entry in entries.values():
            try:
                os.close(entry.fd)
            except OSError:
                pass


def _release_view(mm: mmap.mmap, held: int, pid: int) -> None:
    """Finalizer of a ``get`` result: mark its segment free for the sender (in the process that got it;
    a forked child dropping its copy must not free its parent's value)."""
    if os.getpid() != pid:
        return
    try:
        seg.release_held(mm, held)
    except ValueError:  # mapping closed
        pass


def _close_all(segments: _Segments, mappings: _Mappings) -> None:
    segments.release_all()
    mappings.close_all()


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


def _plain_cpu_tensor(value: torch.Tensor) -> bool:
    """A dense contiguous CPU tensor whose memory holds its values as they are (no lazy conj/neg)."""
    return (
        value.device.type == "cpu"
        and value.layout == torch.strided
        and value.is_contiguous()
        and not value.is_conj()
        and not value.is_neg()
    )


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


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


class SharedMemorySettings(ConnectorSettings, frozen=True, kw_only=True):
    """``extra`` of a ``SharedMemoryConnector``."""

    lease_timeout_s: Annotated[float, Meta(ge=0)] = DEFAULT_LEASE_TIMEOUT_S
    """Seconds the owner keeps an uncollected value; 0: until ``close``."""
    pool_bytes: Annotated[int, Meta(ge=0)] = DEFAULT_POOL_BYTES
    """Total capacity of the pool of reusable segments; 0: no pool, every value in a one-off segment."""
    shm_dir: str = DEFAULT_SHM_DIR
    """Where segment files live (a plain string: pathlib costs ~10 us per put and get, a third of a small
    transfer)."""


class SharedMemoryConnector(OmniConnector):
    """Stage outputs between processes on one host via ``/dev/shm``; see the module docstring and
    :class:`SharedMemorySettings` for ``extra``."""

    Settings = SharedMemorySettings

    def __init__(self, name: str, extra: dict[str, Any] | None = None) -> None:
        super().__init__(name, extra)
        settings: SharedMemorySettings = self.settings
        self.lease_timeout_s = settings.lease_timeout_s
        self.pool_bytes = settings.pool_bytes
        self.shm_dir = settings.shm_dir
        if not os.path.isdir(self.shm_dir):
            raise ValueError(f"connector {name!r}: shared-memory directory {self.shm_dir} does not exist")
        sweep_orphaned_segments(self.shm_dir)
        self._segments = _Segments(name, self.shm_dir, self.lease_timeout_s, self.pool_bytes, self._stats)
        self._mappings = _Mappings()
        # weakref.finalize also runs at interpreter exit (it registers with atexit itself), and does so
        # without keeping the connector alive.
        self._finalizer = weakref.finalize(self, _close_all, self._segments, self._mappings)
        _LIVE.add(self)

    # -- OmniConnector ----------------------------------------------------------------------------------

    def put(self, value: Value) -> ConnectorHandle:
        if self._segments.closed:
            raise ConnectorError(f"connector {self.name!r} is closed")
        created_at = time.time()
        try:
            if isinstance(value, torch.Tensor):
                kind: Literal["tensor", "bytes"] = "tensor"
                if value.layout != torch.strided:
                    raise TypeError(f"cannot put a {value.layout} tensor; only dense (strided) tensors")
                nbytes = value.numel() * value.element_size()
                key = self._put_pooled_tensor(value, nbytes)
                one_off = None if key is not None else _as_bytes_view(value)[0]
            else:
                kind = "bytes"
                data = _as_bytes_view(value)[0]
                nbytes = data.nbytes
                key = self._put_pooled_bytes(data)
                one_off = None if key is not None else data
        except (TypeError, ValueError) as exc:
            self._stats.add(errors=1)
            raise TypeError(f"{self.name}: cannot put {type(value).__name__}: {exc}") from exc
        if one_off is not None:  # no room in the pool (or pooling is off)
            key = self._put_one_off(one_off)
        self._stats.add(puts=1, bytes_put=nbytes)
        tensor = value if kind == "tensor" else None
        return ConnectorHandle(
            connector=self.name,
            key=key,
            kind=kind,
            nbytes=nbytes,
            dtype=_dtype_name(tensor.dtype) if tensor is not None else None,
            shape=tuple(tensor.shape) if tensor is not None else None,
            owner_pid=os.getpid(),
            created_at=created_at,
            lease_timeout_s=self.lease_timeout_s,
        )

    def _put_pooled_tensor(self, value: torch.Tensor, nbytes: int) -> str | None:
        """Copy a tensor into a pool segment and return the key, or None if the pool cannot take it."""
        segment = self._segments.acquire(nbytes)
        if segment is None:
            return None
        try:
            if _plain_cpu_tensor(value):  # the common case: one memmove (without the GIL), no dispatch
                ctypes.memmove(segment.addr, value.data_ptr(), nbytes)
            else:  # one copy from any device or layout of strides, conj/neg resolved on the way
                target = torch.from_numpy(segment.data[:nbytes])
                target.view(value.dtype).view(value.shape).copy_(value.detach())
        except BaseException:
            self._segments.unclaim(segment)
            raise
        return f"{segment.name}@{self._segments.publish(segment, nbytes)}"

    def _put_pooled_bytes(self, data: memoryview) -> str | None:
        segment = self._segments.acquire(data.nbytes)
        if segment is None:
            return None
        try:
            np.copyto(segment.data[: data.nbytes], np.frombuffer(data, dtype=np.uint8))  # memcpy, no GIL
        except BaseException:
            self._segments.unclaim(segment)
            raise
        return f"{segment.name}@{self._segments.publish(segment, data.nbytes)}"

    def _put_one_off(self, data: memoryview) -> str:
        segment = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
        path = os.path.join(self.shm_dir, segment)
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
        return segment

    def get(self, handle: ConnectorHandle, timeout: float | None = None) -> torch.Tensor | bytes:
        """Return the value: a view of a pooled segment (freed when the tensor is collected), or a copy
        out of a one-off segment, which is then freed.

        ``timeout`` is accepted for the interface: a segment is complete before its handle exists, so
        there is nothing to wait for.
        """
        pooled = _POOL_KEY.match(handle.key)
        if pooled is not None:
            value = self._get_pooled(handle, pooled.group(1), int(pooled.group(3)))
        else:
            value = self._get_one_off(handle)
        self._stats.add(gets=1, bytes_got=handle.nbytes)
        return value

    def _open(self, handle: ConnectorHandle, path: str, flags: int) -> int:
        """The segment file behind ``handle``; gone or unreadable ones raise ConnectorError."""
        try:
            return os.open(path, flags | os.O_CLOEXEC)
        except FileNotFoundError:
            raise self._gone(handle) from None
        except OSError as exc:
            self._stats.add(errors=1)
            raise ConnectorError(f"{self.name}: cannot open the segment of {handle.key}: {exc}") from exc

    def _get_one_off(self, handle: ConnectorHandle) -> torch.Tensor | bytes:
        path = self._one_off_path(handle)
        fd = self._open(handle, path, os.O_RDONLY)
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
        return value

    def _get_pooled(self, handle: ConnectorHandle, name: str, gen: int) -> torch.Tensor | bytes:
        try:
            spec = self._tensor_spec(handle) if handle.kind != "bytes" else None
        except ConnectorError:
            self._stats.add(errors=1)
            raise
        if handle.nbytes <= 0:
            self._stats.add(errors=1)
            raise ConnectorError(
                f"{self.name}: handle {handle.key} of a pooled value says {handle.nbytes} bytes"
            )
        put, held = seg.state_word(gen, seg.PUT), seg.state_word(gen, seg.HELD)
        pid = os.getpid()
        mappings = self._mappings
        entry = None
        while entry is None:
            with mappings.lock:
                entry = mappings.entries.get(name)
                if entry is not None and handle.nbytes <= entry.capacity:
                    mm = entry.mm
                    fcntl.flock(entry.fd, fcntl.LOCK_EX)  # against the owner ending a lease or a cleanup
                    try:
                        linked = os.fstat(entry.fd).st_nlink > 0
                        state, stored = seg.claim(mm, gen, handle.nbytes, pid, linked=linked)
                    finally:
                        fcntl.flock(entry.fd, fcntl.LOCK_UN)
            if entry is None:
                mappings.add(name, self._map(handle, name))  # first value from this segment: map it
        if handle.nbytes > entry.capacity:
            self._stats.add(errors=1)
            raise ConnectorError(
                f"{self.name}: handle {handle.key} says {handle.nbytes} bytes, but its segment holds "
                f"up to {entry.capacity}"
            )
        if state != put:
            raise self._gone(handle)
        if stored != handle.nbytes:
            self._stats.add(errors=1)
            raise ConnectorError(
                f"{self.name}: segment of {handle.key} holds {stored} bytes, its handle says {handle.nbytes}"
            )
        if time.monotonic() - mappings.checked >= _STALE_CHECK_S:
            mappings.drop_stale()
        if spec is None:
            data = mm[seg.HEADER_BYTES : seg.HEADER_BYTES + handle.nbytes]
            _release_view(mm, held, pid)
            return data
        dtype, shape = spec
        array = np.frombuffer(mm, dtype=np.uint8, count=handle.nbytes, offset=seg.HEADER_BYTES)
        weakref.finalize(array, _release_view, mm, held, pid)
        tensor = torch.from_numpy(array)
        if dtype != torch.uint8:
            tensor = tensor.view(dtype)
        return tensor.view(shape) if len(shape) != 1 else tensor

    def _map(self, handle: ConnectorHandle, name: str) -> _Mapping:
        """Map a pooled segment into this process (kept: its page tables stay warm)."""
        fd = self._open(handle, os.path.join(self.shm_dir, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size <= seg.HEADER_BYTES:
                raise ConnectorError(f"is {size} bytes, too short for a pooled segment")
            mm = mmap.mmap(fd, size)
            problem = seg.header_problem(mm, size)
            if problem is not None:
                raise ConnectorError(problem)
        except (ConnectorError, OSError, ValueError) as exc:
            os.close(fd)
            self._stats.add(errors=1)
            raise ConnectorError(f"{self.name}: segment of {handle.key} {exc}") from None
        return _Mapping(fd, mm, size - seg.HEADER_BYTES)

    def cleanup(self, handle: ConnectorHandle) -> None:
        pooled = _POOL_KEY.match(handle.key)
        if pooled is None:
            _unlink_quietly(self._one_off_path(handle))
            self._segments.forget(handle.key)
            return
        gen = int(pooled.group(3))
        # Frees a value still put; one a reader holds (or already freed) is not ours to free.
        seg.locked_transition(
            os.path.join(self.shm_dir, pooled.group(1)),
            seg.state_word(gen, seg.PUT),
            seg.state_word(gen, seg.FREE),
        )

    def close(self) -> None:
        self._finalizer()

    def _outstanding(self) -> int:
        return self._segments.count()

    def health(self) -> ConnectorHealth:
        # Receivers in other processes free segments without telling us: look before counting.
        self._segments.reap()
        return super().health()

    # -- helpers ---------------------------------------------------------------------------------------

    def _after_fork_in_child(self) -> None:
        self._segments.after_fork_in_child()  # in place: the finalizer now releases the child's own
        self._mappings.after_fork_in_child()
        self._stats.lock = threading.Lock()

    def _one_off_path(self, handle: ConnectorHandle) -> str:
        if _SEGMENT_NAME.match(handle.key) is None:
            self._stats.add(errors=1)
            raise ConnectorError(
                f"{self.name}: handle key {handle.key!r} is not a shared-memory segment name "
                f"(handle of connector {handle.connector!r})"
            )
        return os.path.join(self.shm_dir, handle.key)

    def _gone(self, handle: ConnectorHandle) -> ConnectorError:
        """Why a value is missing, as far as the handle lets us tell."""
        age = time.time() - handle.created_at
        if handle.lease_timeout_s > 0 and age >= handle.lease_timeout_s:
            self._stats.add(timeouts=1)
            return ConnectorTimeoutError(
                f"{self.name}: value {handle.key} was not collected within its lease of "
                f"{handle.lease_timeout_s:g} s (put {age:.1f} s ago); its owner (pid {handle.owner_pid}) "
                "freed it"
            )
        self._stats.add(errors=1)
        if handle.owner_pid and not _pid_alive(handle.owner_pid):
            return ConnectorError(
                f"{self.name}: value {handle.key} is gone: its owner (pid {handle.owner_pid}) exited"
            )
        return ConnectorError(
            f"{self.name}: value {handle.key} does not exist: already collected by a get, or released "
            f"by cleanup/close of its owner (pid {handle.owner_pid})"
        )

    def _tensor_spec(self, handle: ConnectorHandle) -> tuple[torch.dtype, tuple[int, ...]]:
        """The dtype and shape a tensor handle names, checked against its size."""
        if handle.kind != "tensor" or handle.dtype is None or handle.shape is None:
            raise ConnectorError(f"{self.name}: handle {handle.key} is malformed (kind {handle.kind!r})")
        dtype = dtype_from_name(handle.dtype)
        shape = tuple(handle.shape)
        numel = 1
        for dim in shape:
            if dim < 0:
                raise ConnectorError(f"{self.name}: handle {handle.key} has a negative dimension {shape}")
            numel *= dim
        if numel * dtype.itemsize != handle.nbytes:
            raise ConnectorError(
                f"{self.name}: handle {handle.key}: {handle.nbytes} bytes cannot hold "
                f"{handle.dtype}{list(shape)}"
            )
        return dtype, shape

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
        dtype, shape = self._tensor_spec(handle)
        out = torch.empty(shape, dtype=dtype)
        if handle.nbytes:
            _read_all(fd, memoryview(out.reshape(-1).view(torch.uint8).numpy()), handle.key)
        return out


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
