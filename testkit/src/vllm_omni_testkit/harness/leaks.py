"""What a test run (or a benchmark) leaves behind: processes it started and ``/dev/shm`` segments they
made, told apart from those of other users of the machine.

:class:`LeakWatch` follows, from a background thread, every process descending from this one and the
``/dev/shm`` files they map (``psm_*``, ``sem.*``, ours). A process is remembered by pid and start time,
so one reparented after its parent died still counts, and a later process reusing its pid does not. A
segment counts as the run's if one of its processes mapped it, or if it is one of ours named after one of
them (``vllm_omni_<pid>_*``). Segments that a process of the run mapped for less than a poll interval
can escape it; everything that lives as long as an engine does not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from vllm_omni_plugin.log import best_effort
from vllm_omni_plugin.processes import (
    SHM_DIR,
    ProcessId,
    children_of_every_process,
    cmdline,
    descendants,
    mapped_segments,
    segment_owner,
    unlink_segment,
)

RESOURCE_TRACKER = "from multiprocessing.resource_tracker import main"
POLL_INTERVAL_S = 0.5
"""How often a watch looks: a poll lists /dev/shm and, where a segment there is not yet accounted for,
reads every watched process's memory map (about 7 ms of CPU for one served deployment's processes); the
segments an engine maps live as long as it does."""


FOREIGN_POLLS = 4
"""Looks at ``/proc`` (:class:`_SharedLook`, each a new one) after which a segment none of the run's
processes maps is taken for another's (a parallel test worker's): a process maps what it creates at once,
so only a segment mapped for less than a poll interval can escape, as it could before. Polls within one
look count once: a busy machine's polls all read the same stale maps."""

SHARED_LOOK_S = 0.25
"""How long one look at ``/proc`` serves every watch of this process (a test often runs several, each
polling; reading every process's stat and a large process's memory map is most of what a watch costs)."""

_SPARED: set[ProcessId] = set()


class _SharedLook:
    """The process table and the memory maps read by one watch's poll, reused by the others' polls within
    :data:`SHARED_LOOK_S`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken = float("-inf")
        self.generation = 0
        """Counts the looks taken: a segment is unmapped by the run's processes in as many looks as it
        was counted in distinct generations (the polls within one look all see the same maps)."""
        self._children: dict[int, list[int]] = {}
        self._maps: dict[ProcessId, set[str]] = {}

    def _fresh(self, now: float) -> None:
        if now - self._taken > SHARED_LOOK_S:
            self._children = children_of_every_process()
            self._maps = {}
            self._taken = now
            self.generation += 1

    def children(self, *, fresh: bool = False) -> dict[int, list[int]]:
        with self._lock:
            if fresh:
                self._taken = float("-inf")
            self._fresh(time.monotonic())
            return self._children

    def mapped(self, process: ProcessId) -> set[str]:
        with self._lock:
            self._fresh(time.monotonic())
            known = self._maps.get(process)
        if known is None:
            known = mapped_segments(process.pid)
            with self._lock:
                self._maps[process] = known
        return known


_LOOK = _SharedLook()


def spare_from_watches(pid: int) -> None:
    """The test harness's own long-lived helper (a fork server): no watch counts it as left behind,
    though they follow the processes it starts."""
    if (process := ProcessId.of(pid)) is not None:
        _SPARED.add(process)


@dataclass
class Leftovers:
    processes: dict[int, str] = field(default_factory=dict)
    """Pid -> command line of each process of the run still running."""
    segments: list[str] = field(default_factory=list)
    mappers: dict[str, str] = field(default_factory=dict)
    """Segment -> the process of the run seen mapping it first (pid and command line), where known."""

    def __bool__(self) -> bool:
        return bool(self.processes or self.segments)

    def describe(self) -> str:
        lines = []
        if self.processes:
            lines.append(f"{len(self.processes)} process(es) still running:")
            lines += [f"  pid {pid}: {cmd[:160]}" for pid, cmd in sorted(self.processes.items())]
        if self.segments:
            lines.append(f"{len(self.segments)} /dev/shm segment(s) left: {', '.join(self.segments)}")
            lines += [f"  {name}: first mapped by {who}" for name, who in sorted(self.mappers.items())]
        return "\n".join(lines)


class LeakWatch:
    """Follows the processes under ``root`` (default: this process) and what they map in ``shm_dir``."""

    def __init__(
        self,
        root: int | None = None,
        *,
        interval: float = POLL_INTERVAL_S,
        shm_dir: str = SHM_DIR,
        only_new: bool = True,
        only_new_processes: bool = False,
    ) -> None:
        self.root = root if root is not None else os.getpid()
        self.root_id = ProcessId.of(self.root)
        self.interval = interval
        self.shm_dir = shm_dir
        self.processes: dict[int, ProcessId] = {}
        self.commands: dict[int, str] = {}
        self.segments: dict[str, int] = {}
        """Segment name -> the first process of the run seen mapping it."""
        self.before = set(self._listing()) if only_new else set()
        """Segments there before the watch began (not the run's, with ``only_new``)."""
        self.earlier: set[ProcessId] = set()
        """With ``only_new_processes``: descendants already running when the watch began, which belong
        to whatever started them (a watch of one part of a test run, beside what earlier tests left)."""
        if only_new_processes:
            self.earlier = {p for p in map(ProcessId.of, descendants(self.root)) if p is not None}
        self._unmapped: dict[str, tuple[int, int]] = {}
        """Segment -> (looks at ``/proc`` in which none of the run's processes mapped it, the last one's
        generation)."""
        """Segments in /dev/shm that no process of the run mapped, with the polls that found so."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _listing(self) -> list[str]:
        try:
            return os.listdir(self.shm_dir)
        except OSError:
            return []

    def start(self) -> LeakWatch:
        self._thread = threading.Thread(target=self._run, name="leak-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with best_effort("polling the run's processes and segments (the watch goes on)"):
                self.poll(shared=True)

    def poll(self, *, shared: bool = False) -> None:
        """Record the live descendants and the segments every recorded process maps now (``shared``: or
        as another watch's poll read ``/proc`` a moment ago: the background thread's polls)."""
        with self._lock:
            for pid in descendants(self.root, _LOOK.children(fresh=not shared)):
                known = self.processes.get(pid)
                if known is None or not known.alive():
                    pid_id = ProcessId.of(pid)
                    if pid_id is not None and pid_id not in self.earlier:
                        self.processes[pid] = pid_id
                        self.commands[pid] = cmdline(pid)
            # A process's memory map names only files that are in /dev/shm now: while every one there is
            # accounted for (there before the watch, its mapper known, or nobody's of the run for
            # FOREIGN_POLLS polls: another test worker's), reading maps finds nothing new.
            listed = set(self._listing())
            self._unmapped = {name: n for name, n in self._unmapped.items() if name in listed}
            unknown = {
                name
                for name in listed - self.before - self.segments.keys()
                if self._unmapped.get(name, (0, 0))[0] < FOREIGN_POLLS
            }
            # ours name their owner, no memory map needs reading: the run's once the owner is one of its
            # processes (it may be seen at a later poll), another's after FOREIGN_POLLS polls
            watched = {self.root, *self.processes}
            for name in list(unknown):
                owner = segment_owner(name)
                if owner is None:
                    continue
                unknown.discard(name)
                if owner in watched:
                    self.segments.setdefault(name, owner)
                else:
                    self._count_unmapped(name)
            if not unknown:
                return
            for process in (self.root_id, *[p for p in self.processes.values() if p.alive()]):
                if process is None:
                    continue
                for name in _LOOK.mapped(process) & unknown:
                    self.segments.setdefault(name, process.pid)
            for name in unknown - self.segments.keys():
                self._count_unmapped(name)

    def _count_unmapped(self, name: str) -> None:
        """One more look in which none of the run's processes maps ``name`` (lock held): polls that share
        a look count once, so how often the watch polls does not decide what is foreign."""
        looks, counted = self._unmapped.get(name, (0, 0))
        if _LOOK.generation != counted:
            self._unmapped[name] = (looks + 1, _LOOK.generation)

    def running(self) -> dict[int, str]:
        """Processes of the run still running, except this process's own resource tracker (it ends with
        this process). Each is named by the command line it has now: one first seen between its fork and
        its exec was recorded with its parent's."""
        with self._lock:
            alive = [
                p for p in self.processes.values() if p.alive() and p.pid != self.root and p not in _SPARED
            ]
            for p in alive:
                self.commands[p.pid] = cmdline(p.pid) or self.commands.get(p.pid, "")
            commands = {p.pid: self.commands[p.pid] for p in alive}
        return {
            pid: command
            for pid, command in commands.items()
            if not (RESOURCE_TRACKER in command and _parent(pid) == self.root)
        }

    def left_segments(self) -> list[str]:
        with self._lock:
            pids = {self.root, *self.processes}
            mapped = set(self.segments)
        left = []
        for name in self._listing():
            if name in self.before:
                continue
            owner = segment_owner(name)
            if name in mapped or (owner is not None and owner in pids):
                left.append(name)
        return sorted(left)

    def leftovers(self, grace: float = 0.0, *, processes_only: bool = False) -> Leftovers:
        """What is left, after waiting up to ``grace`` s for it to go. The wait ends early once every
        watched process is gone, the root too (a watch of another process's tree: a server's): nothing
        of the tree is left to remove a segment then, so what is there stays (a SIGKILLed deployment's
        segments, left for the next start's sweep). ``processes_only``: end it once the processes are
        gone whatever the root (a watch of this process whose caller removes what they left)."""
        deadline = time.monotonic() + grace
        while True:
            running = self.running()
            left = Leftovers(running, self.left_segments())
            settled = not running and (processes_only or self._root_gone())
            if not left or time.monotonic() >= deadline or settled:
                with self._lock:
                    for name in left.segments:
                        pid = self.segments.get(name)
                        if pid is not None:
                            left.mappers[name] = f"pid {pid} ({self.commands.get(pid, 'this process')[:120]})"
                return left
            time.sleep(0.2)

    def _root_gone(self) -> bool:
        if self.root == os.getpid():
            return False
        return self.root_id is None or not self.root_id.alive()

    def clean(self, left: Leftovers) -> None:
        """Kill the leftover processes and remove the leftover segments."""
        for pid in left.processes:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for name in left.segments:
            unlink_segment(name, self.shm_dir)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None
