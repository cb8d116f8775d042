"""The processes a stage replica runs and the shared memory they hold, read from ``/proc`` (Linux).

vLLM's engine processes make ``/dev/shm`` segments that the API process never sees: the EngineCore's
scheduler-output broadcast queue (``psm_*``, 16 MiB x 10 chunks by default), each worker's response
queue (``psm_*``, 24 MiB x 10) and multiprocessing semaphores (``sem.mp-*``). The process that made one
unlinks it when it exits cleanly; otherwise multiprocessing's resource tracker does, once every process
sharing the tracker has exited. Two stops defeat both: an EngineCore that a second SIGTERM finds past
its handler (vLLM resets it to the default while tearing down, so the signal our shutdown sends after the
group's own kills it), and a container runtime that SIGKILLs the group, tracker included, as soon as the
main process is gone. So a replica's client records what the replica's processes map while they run
(:class:`ProcessTree`), and once they are gone unlinks what is left (:meth:`ProcessTree.release`) before
the main process exits or the replica restarts.

Two more things about the processes we start: :func:`exit_with_parent` stops a process whose parent died
(vLLM's EngineCore does not notice the death of the API process by itself), and
:func:`spawning_without_main` keeps spawned stage processes from re-running the user's script (so the
offline API works in a script without a ``__main__`` guard).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_plugin.log import best_effort, get_logger

logger = get_logger(__name__)

SHM_DIR = "/dev/shm"
OUR_SEGMENT_PREFIX = "vllm_omni_"
"""Our connectors' segments: ``vllm_omni_<owner pid>_...``."""
_MAPPED_SHM = re.compile(r" /dev/shm/(\S+)$", re.MULTILINE)
_OWNER = re.compile(r"^vllm_omni_(\d+)_")
PARENT_POLL_S = 0.5


def segment_owner(name: str) -> int | None:
    """The owner pid one of our segments is named after (None: not one of ours)."""
    match = _OWNER.match(name)
    return None if match is None else int(match.group(1))


# --- reading /proc ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessId:
    """A process, told apart from a later one that reuses its pid by its start time."""

    pid: int
    start: int
    """Start time in clock ticks after boot (``/proc/PID/stat`` field 22)."""

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        stat = _stat(pid)
        return None if stat is None else cls(pid, stat[1])

    def alive(self) -> bool:
        """Running (a zombie, killed and not yet reaped, has exited)."""
        stat = _stat(self.pid)
        return stat is not None and stat[1] == self.start and stat[2] not in ("Z", "X")


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time, state) of ``pid``, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    try:
        return int(fields[1]), int(fields[19]), fields[0]
    except (IndexError, ValueError):
        return None


def _pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def children_of_every_process() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, for every process on the host, as ``/proc`` lists them now."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        stat = _stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append(pid)
    return children


def descendants(root: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every live descendant of ``root`` (children, their children, ...), in no particular order;
    ``children``: a :func:`children_of_every_process` taken a moment ago (several trees looked at
    together), else one taken now."""
    if children is None:
        children = children_of_every_process()
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def mapped_segments(pid: int) -> set[str]:
    """Names of the ``/dev/shm`` files ``pid`` maps (unlinked ones excluded)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            text = f.read()
    except OSError:
        return set()
    return set(_MAPPED_SHM.findall(text))


def rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


# --- what a replica's processes hold ------------------------------------------------------------------


def tracker_name(segment: str) -> tuple[str, str] | None:
    """How multiprocessing's resource tracker knows a ``/dev/shm`` file: (name, resource type)."""
    if segment.startswith("psm_"):
        return "/" + segment, "shared_memory"
    if segment.startswith("sem."):
        return "/" + segment.removeprefix("sem."), "semaphore"
    return None


def unlink_segment(name: str, shm_dir: str = SHM_DIR) -> bool:
    """Remove ``/dev/shm/name``, and tell the resource tracker this process shares (if it runs one) that
    it is gone, so the tracker does not warn about it, or try again, at exit. True if it was there."""
    try:
        os.unlink(os.path.join(shm_dir, name))
    except FileNotFoundError:
        return False
    known = tracker_name(name)
    if known is not None and _tracker_runs():
        from multiprocessing import resource_tracker

        with best_effort("unregistering removed segments from the resource tracker", logger):
            resource_tracker.unregister(*known)
    return True


def own_resource_tracker() -> int | None:
    """The pid of the resource tracker this process started (None: it started none): a child that is
    not a stage's, which ignores SIGTERM and ends with this process."""
    tracker = _resource_tracker()
    return None if tracker is None else tracker._pid


def _resource_tracker() -> Any:
    """multiprocessing's resource tracker of this process, if it is connected to one (None: not)."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    return tracker if getattr(tracker, "_fd", None) is not None else None


def _tracker_runs() -> bool:
    """Whether this process shares a resource tracker that still runs. Never start one to unregister a
    segment, nor talk to a dead one: multiprocessing would start a new tracker, which prints a traceback
    for every name it was never told of."""
    tracker = _resource_tracker()
    if tracker is None:
        return False
    if tracker._pid is None:  # inherited from the process that started it
        return True
    process = ProcessId.of(tracker._pid)
    return process is not None and process.alive()


def _mapped_inodes(pid: int, shm_dir: str = SHM_DIR) -> set[int]:
    """Inodes of the ``shm_dir`` files ``pid`` maps, unlinked names included."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    prefix = shm_dir.rstrip("/") + "/"
    held: set[int] = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(prefix) and fields[4].isdigit():
            held.add(int(fields[4]))
    return held


def unmapped(names: list[str], shm_dir: str = SHM_DIR) -> list[str]:
    """Which of the ``shm_dir`` files ``names`` no live process maps, told by inode: a semaphore's
    creator maps it under the temporary name ``sem_open`` made it with (shown as deleted), so its final
    name appears in no mapping while it is in use."""
    inodes = _by_inode(names, shm_dir)
    held: set[int] = set()
    for pid in _pids():
        held |= _mapped_inodes(pid, shm_dir)
    return sorted(name for inode, name in inodes.items() if inode not in held)


def semaphores_of(pids: Iterable[int], shm_dir: str = SHM_DIR) -> list[str]:
    """The named semaphores (``sem.*``) in ``shm_dir`` that ``pids`` map, found by inode (see
    ``unmapped``)."""
    inodes = _by_inode([name for name in os.listdir(shm_dir) if name.startswith("sem.")], shm_dir)
    held: set[int] = set()
    for pid in pids:
        held |= _mapped_inodes(pid, shm_dir)
    return sorted(name for inode, name in inodes.items() if inode in held)


def _by_inode(names: list[str], shm_dir: str) -> dict[int, str]:
    """Inode -> name of those of the ``shm_dir`` files ``names`` still there."""
    inodes: dict[int, str] = {}
    for name in names:
        with contextlib.suppress(OSError):
            inodes[os.stat(os.path.join(shm_dir, name)).st_ino] = name
    return inodes


def _held_elsewhere(names: set[str], exclude: set[int]) -> set[str]:
    """Which of ``names`` a live process outside ``exclude`` maps."""
    held: set[str] = set()
    for pid in _pids():
        if pid in exclude:
            continue
        held |= names & mapped_segments(pid)
        if held == names:
            break
    return held


@dataclass
class ProcessTree:
    """The processes of one replica (its root and every descendant seen) and the ``/dev/shm`` files they
    mapped, recorded while they run so that what they leave can be removed once they are gone."""

    label: str
    members: dict[int, ProcessId] = field(default_factory=dict)
    segments: set[str] = field(default_factory=set)

    def record(self, root: int | None) -> ProcessTree:
        """Add ``root``, its live descendants and the segments they map (call while they run)."""
        if root is None:
            return self
        for pid in (root, *descendants(root)):
            pid_id = self.members.get(pid)
            if pid_id is None or not pid_id.alive():
                pid_id = ProcessId.of(pid)
                if pid_id is None:
                    continue
                self.members[pid] = pid_id
            self.segments |= mapped_segments(pid)
        return self

    def alive(self) -> list[ProcessId]:
        return [p for p in self.members.values() if p.alive()]

    def wait_gone(self, timeout: float) -> list[ProcessId]:
        """Wait until every member has exited, at most ``timeout`` s; returns those still running."""
        deadline = time.monotonic() + timeout
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def kill(self, timeout: float = 5.0) -> list[ProcessId]:
        """SIGKILL the members still running; returns those that still did not go."""
        for member in self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(member.pid, signal.SIGKILL)
        return self.wait_gone(timeout)

    def end(self, shm_dir: str = SHM_DIR) -> list[str]:
        """SIGKILL the members at once, then :meth:`release`: for what is left of a replica whose root
        died (an engine core's workers), which has nothing to finish and would only delay its restart
        while it noticed (seconds on a loaded host)."""
        self.kill()
        return self.release(shm_dir)

    def release(self, shm_dir: str = SHM_DIR) -> list[str]:
        """Remove the segments the members left: their own (``vllm_omni_<member pid>_*``) and the
        ``psm_*`` / ``sem.*`` files they mapped that no live process maps. Members still running keep
        theirs. Returns the names removed."""
        running = {p.pid for p in self.alive()}
        dead = {pid for pid in self.members if pid not in running}
        try:
            present = set(os.listdir(shm_dir))
        except OSError:
            return []
        ours = {name for name in present if segment_owner(name) in dead}
        foreign: set[str] = set()
        if not running:  # while a member runs it may still use them
            foreign = {name for name in self.segments & present if tracker_name(name) is not None}
            if foreign:
                foreign -= _held_elsewhere(foreign, exclude=set(self.members))
        removed = sorted(name for name in ours | foreign if unlink_segment(name, shm_dir))
        if removed:
            logger.info(
                "%s: removed %d shared-memory segment(s) its processes left: %s",
                self.label,
                len(removed),
                ", ".join(removed),
            )
        return removed

    def stop(self, grace: float, shm_dir: str = SHM_DIR) -> list[str]:
        """Wait ``grace`` s for the members to exit, SIGKILL any that did not, then :meth:`release`."""
        left = self.wait_gone(grace)
        if left:
            logger.warning(
                "%s: process(es) %s still running %.0f s after the stop; killing them",
                self.label,
                ", ".join(str(p.pid) for p in left),
                grace,
            )
            self.kill()
        return self.release(shm_dir)


@contextlib.contextmanager
def temporary_environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in this process's environment for the block, then as it was: what the processes started
    in it inherit (vLLM's engine processes: device selection), or what a constructor reads (Mooncake's
    engine: its transfer timeout).

    One block at a time in the process (replicas start and restart on threads of their own): two
    overlapping blocks would start one replica's engine with the other's devices and endpoints, and
    restore each other's values when they end."""
    with _environment_lock:
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@contextlib.contextmanager
def settled_environment() -> Iterator[None]:
    """No ``temporary_environment`` of another thread is in force during the block: a process started
    in it inherits this process's own environment."""
    with _environment_lock:
        yield


_environment_lock = threading.RLock()


# --- processes we start -------------------------------------------------------------------------------

_parent_watch: threading.Thread | None = None


def exit_with_parent(what: str, on_parent_death: Callable[[], None] | None = None) -> None:
    """In a process started by ``multiprocessing``: once the parent that started it is gone, call
    ``on_parent_death`` (default: send this process SIGTERM, so its own handler stops it cleanly and it
    frees what it holds). A no-op in a process that multiprocessing did not start, and after the first
    call."""
    global _parent_watch
    parent = multiprocessing.parent_process()
    if parent is None or _parent_watch is not None:
        return
    parent_pid = parent.pid

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        logger.warning("%s: parent process %s is gone; stopping", what, parent_pid)
        if on_parent_death is not None:
            on_parent_death()
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    _parent_watch = threading.Thread(target=watch, name="omni-parent-watch", daemon=True)
    _parent_watch.start()


def run_exit_functions() -> None:
    """What a process runs at its end before the interpreter tears its modules down: multiprocessing's
    finalizers (as its process bootstrap runs them after the target), non-daemon threads joined, the
    ``atexit`` functions, its output flushed."""
    import atexit
    from multiprocessing import util

    util._exit_function()
    getattr(threading, "_shutdown")()  # noqa: B009 - the interpreter's own first step at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.flush()


def end_process(code: int = 0) -> None:
    """End this process with ``code`` as a process that ``multiprocessing`` forks ends
    (:func:`run_exit_functions`, then ``os._exit``): the interpreter does not tear its modules down one
    by one, which costs about two seconds of CPU at every stop of a process that imported torch,
    diffusers and vLLM. For the processes we start and stop ourselves (a diffusion stage's, a parallel
    peer's), once they released what they hold."""
    try:
        run_exit_functions()
    finally:
        os._exit(code)


_main_lock = threading.Lock()
_main_users = 0
_main_spec: object = None


@contextlib.contextmanager
def spawning_without_main() -> Iterator[None]:
    """Processes spawned meanwhile (ours, vLLM's EngineCore) do not import the ``__main__`` module.

    A spawned child normally runs the parent's main script again (as ``__mp_main__``) before its target;
    a script without a ``__main__`` guard then starts the whole deployment again inside the child, and
    multiprocessing refuses ("...before the current process has finished its bootstrapping phase").
    Stage processes need nothing from the user's script, so while this is active ``__main__`` carries a
    spec named ``__main__``, which multiprocessing's spawn takes as "nothing to import".
    """
    global _main_users, _main_spec
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    with _main_lock:
        if _main_users == 0:
            _main_spec = getattr(main, "__spec__", None)
            main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
        _main_users += 1
    try:
        yield
    finally:
        with _main_lock:
            _main_users -= 1
            if _main_users == 0:
                main.__spec__ = _main_spec
                _main_spec = None


def usable_cores() -> list[int]:
    """The ids of the cores this process may run on (its affinity: ``taskset``, cgroups), sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))
