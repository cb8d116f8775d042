"""The guard that fails a test run leaving processes or shared-memory segments behind (``LeakWatch``), and the
replica-side cleanup it relies on (``ProcessTree``), on real processes and real ``/dev/shm`` files."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import signal
import sys
import time
from multiprocessing import shared_memory

import pytest

from vllm_omni_plugin.processes import (
    SHM_DIR,
    ProcessTree,
    cmdline,
    exit_with_parent,
    mapped_segments,
    unlink_segment,
    unmapped,
)
from vllm_omni_testkit.harness.leaks import RESOURCE_TRACKER, LeakWatch

pytestmark = pytest.mark.processes


def hold_segment(name_queue: multiprocessing.Queue, ours: bool) -> None:
    """A child that makes a segment (vLLM's kind, or one of ours named after it), reports it and waits."""
    if ours:
        name = f"vllm_omni_{os.getpid()}_{secrets.token_hex(8)}"
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"x" * 4096)
        name_queue.put(name)
    else:
        segment = shared_memory.SharedMemory(create=True, size=1 << 20)
        name_queue.put(segment.name)
    time.sleep(600)


def start_holder(
    spawn: multiprocessing.context.SpawnContext, ours: bool = False
) -> tuple[multiprocessing.Process, str]:
    queue = spawn.Queue()
    child = spawn.Process(target=hold_segment, args=(queue, ours), daemon=True)
    child.start()
    return child, queue.get(timeout=60)


def test_the_watch_finds_what_a_killed_child_left_and_cleans_it(spawn) -> None:
    watch = LeakWatch(interval=0.05).start()
    child, name = start_holder(spawn)
    ours_child, ours = start_holder(spawn, ours=True)
    stranger = f"psm_{secrets.token_hex(4)}"  # made by nobody of this run (another user of the machine)
    open(os.path.join(SHM_DIR, stranger), "wb").close()
    try:
        watch.poll()  # both children and what they map, seen now (the background polls may lag)
        left = watch.leftovers()
        assert {child.pid, ours_child.pid} <= set(left.processes)
        assert name in left.segments and ours in left.segments and stranger not in left.segments
        os.kill(child.pid, signal.SIGKILL)  # its segment stays: nobody unlinks it now
        child.join(10)
        left = watch.leftovers()
        assert child.pid not in left.processes and name in left.segments
        assert f"{name}" in left.describe() and str(ours_child.pid) in left.describe()
        watch.clean(left)
        ours_child.join(10)
        assert not watch.leftovers(grace=5)
        assert not os.path.exists(os.path.join(SHM_DIR, name)) and not os.path.exists(
            os.path.join(SHM_DIR, ours)
        )
    finally:
        watch.stop()
        os.unlink(os.path.join(SHM_DIR, stranger))
        for proc in (child, ours_child):
            if proc.is_alive():
                proc.kill()
                proc.join(10)


def test_a_resource_tracker_first_seen_before_its_exec_is_still_this_process_own() -> None:
    """A child seen between its fork and its exec carries this process's command line; the watch judges
    it by the one it has when asked (a run once failed on its own resource tracker, caught in that gap)."""
    watch = LeakWatch()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: held before its exec until the watch has seen it
        try:
            os.close(go_write)
            os.read(go_read, 1)
            code = "from multiprocessing.resource_tracker import main; import time; time.sleep(60)"
            os.execv(sys.executable, [sys.executable, "-c", code])
        finally:
            os._exit(1)
    os.close(go_read)
    try:
        watch.poll()
        assert RESOURCE_TRACKER not in watch.commands[pid]  # recorded under this process's command line
        os.write(go_write, b"x")
        deadline = time.monotonic() + 60
        while RESOURCE_TRACKER not in cmdline(pid):
            assert time.monotonic() < deadline, "the child did not exec"
            time.sleep(0.01)
        assert watch.running() == {}
    finally:
        os.close(go_write)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def hold_semaphore(name_queue: multiprocessing.Queue) -> None:
    """A child that makes a named semaphore (as vLLM's engines do for their workers) and waits."""
    lock = multiprocessing.get_context("spawn").Lock()
    name_queue.put("sem." + lock._semlock.name.lstrip("/"))
    time.sleep(600)


def test_a_semaphore_in_use_counts_as_mapped_though_no_mapping_names_it(spawn) -> None:
    """``sem_open`` maps a new semaphore under a temporary name: only its inode tells that it is in use
    (a test that removed every new ``sem.*`` once removed another run's starting engine's)."""
    queue = spawn.Queue()
    child = spawn.Process(target=hold_semaphore, args=(queue,), daemon=True)
    child.start()
    name = queue.get(timeout=60)
    try:
        assert os.path.exists(os.path.join(SHM_DIR, name))
        assert name not in mapped_segments(child.pid)  # no mapping names it ...
        assert unmapped([name]) == []  # ... yet it is in use
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert unmapped([name]) == [name]  # its only user is gone
    finally:
        if child.is_alive():
            child.kill()
        unlink_segment(name)


def test_a_replica_tree_removes_what_its_dead_processes_left(spawn) -> None:
    child, name = start_holder(spawn)
    tree = ProcessTree("test replica").record(child.pid)
    assert name in tree.segments and name in mapped_segments(child.pid)
    assert tree.release() == []  # its process still runs: nothing is taken from it
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert tree.stop(grace=5) == [name]
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_replica_tree_kills_a_member_that_does_not_exit(spawn) -> None:
    child, name = start_holder(spawn)
    tree = ProcessTree("test replica").record(child.pid)
    assert tree.stop(grace=0.2) == [name]  # SIGKILLed after the grace, then cleaned
    child.join(10)
    assert child.exitcode == -signal.SIGKILL


def exits_with_parent(pid_queue: multiprocessing.Queue) -> None:
    """A grandchild: reports its pid, then waits for its parent (the child) to die."""
    got: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: got.append(1))
    exit_with_parent("test grandchild")
    pid_queue.put(os.getpid())
    while not got:
        time.sleep(0.05)


def start_grandchild(pid_queue: multiprocessing.Queue) -> None:
    spawn = multiprocessing.get_context("spawn")
    spawn.Process(target=exits_with_parent, args=(pid_queue,)).start()
    time.sleep(600)


def test_exit_with_parent_stops_a_process_whose_parent_was_killed(spawn) -> None:
    queue = spawn.Queue()
    child = spawn.Process(target=start_grandchild, args=(queue,))
    child.start()
    grandchild = queue.get(timeout=60)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:
        with open(f"/proc/{grandchild}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "Z":
                break
        time.sleep(0.05)
    else:
        if os.path.exists(f"/proc/{grandchild}"):
            pytest.fail("the grandchild outlived its parent")
