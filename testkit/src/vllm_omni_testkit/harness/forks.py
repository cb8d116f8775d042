"""Starts ``vllm`` command lines (servers included) as forks of one process that imported vLLM once.

Every ``vllm serve`` a test starts spends about seven seconds of CPU importing vLLM, torch, transformers
and diffusers before it reads its first argument; the suite starts dozens. A :class:`VllmForks` keeps
one process (the *fork server*) that imported them once, and starts each command line as a fork of it:
its own session, pid, environment, working directory, output files and exit status, running the stock
console script (``bin/vllm``, as its ``__main__``, so that multiprocessing's spawned children start as
a user's would) and ending as the interpreter ends a script (threads joined, ``atexit`` handlers run, an
uncaught Ctrl-C re-raised as the signal). The fork server loads no vLLM plugin: each child loads ours
from its entry point, as the console script does.

A command line forks only where its environment equals the fork server's, but for variables nothing
reads at import (``READ_WHEN_USED``): what is imported depends on the environment (``VLLM_PLUGINS``,
``PYTHONPATH``, thread settings read when a library loads); any other runs as a fresh process. Tests
that check how a user's process starts or stops (tests/test_stops.py) give their servers environments
of their own, so they run fresh.

Run as a module, this is the fork server: one JSON object per line on stdin (``{"id", "argv", "env",
"cwd", "stdout", "stderr"}``), answered with ``{"id", "pid"}``; ``{"pid", "returncode"}`` follows when
that child ends. It ends when its stdin closes.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_omni_plugin.processes import ProcessId
from vllm_omni_testkit.harness.leaks import spare_from_watches

PRELOADED = (
    "torch",
    "transformers",
    "diffusers",
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.cli.openai",
    "vllm.entrypoints.cli.benchmark.main",
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.async_llm",
)
"""What the fork server imports: the costly part of every ``vllm`` start (no plugin among them)."""
READ_WHEN_USED = frozenset({
    "VLLM_OMNI_HOLD_DIR", "VLLM_OMNI_TEST_HOOKS", "VLLM_OMNI_FAULT_SEED",  # the test seam's
    "VLLM_LOG_STATS_INTERVAL",  # vllm.envs reads it when the engine logs its stats
    "RAY_ADDRESS",  # ray.init
})  # fmt: skip
"""Variables that may differ between a fork and the fork server: nothing imported reads them at import."""

VLLM = str(Path(sys.executable).parent / "vllm")
"""The stock console script this environment runs (what forks)."""

_active: VllmForks | None = None


def active_forks() -> VllmForks | None:
    """The session's fork server (``ServerProcess`` starts ``vllm`` through it where it can)."""
    return _active


# --- the fork server --------------------------------------------------------------------------------------


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(case: dict[str, Any], own: Sequence[int]) -> None:
    """In the fork: become the command line ``case`` names, and end as the interpreter ends; ``own``:
    the fork server's descriptors beyond the standard three, closed here."""
    import atexit
    import random
    import runpy
    import tempfile
    import traceback

    status, interrupted = 1, False
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(case["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = out
        if case["stderr"] != case["stdout"]:
            err = os.open(case["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        for fd in {null, out, err, *own}:
            os.close(fd)
        os.chdir(case["cwd"])
        os.environ.clear()
        os.environ.update(case["env"])
        tempfile.tempdir = None  # read from TMPDIR again
        random.seed()  # a process of its own draws its own numbers
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        sys.argv = list(case["argv"])
        try:
            runpy.run_path(case["argv"][0], run_name="__main__")
            status = 0
        except SystemExit as stop:
            status = _exit_status(stop.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            interrupted = True
        except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
            traceback.print_exc()
            status = 1
        getattr(threading, "_shutdown")()  # noqa: B009 - what the interpreter does at exit, in order
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        if interrupted:  # as CPython ends on an uncaught KeyboardInterrupt: killed by the signal
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        os._exit(status)


def _serve() -> None:
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through the wakeup fd
    out = sys.stdout

    def say(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    say({"ready": True})
    stdin = sys.stdin.fileno()
    pending = b""
    while True:
        readable, _, _ = select.select([stdin, wake_read], [], [])
        if wake_read in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_read, 4096)
        while True:  # every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            say({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})
        if stdin in readable:
            chunk = os.read(stdin, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                case = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(case, (wake_read, wake_write))
                say({"id": case["id"], "pid": pid})


# --- the test side ----------------------------------------------------------------------------------------


class ForkedProcess:
    """A command line started by the fork server, with what tests use of ``subprocess.Popen``."""

    def __init__(self, forks: VllmForks, pid: int, args: Sequence[str]) -> None:
        self.forks = forks
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.forks._returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None and not self.forks._wait_exit(self.pid, timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        code = self.poll()
        assert code is not None
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class VllmForks:
    """The test side of one fork server per test process, started at its first use and again where it
    is gone (a test's clean-up may end it with the other processes its watch found)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._answers: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._children: set[int] = set()
        self._next_id = 0

    def activate(self) -> VllmForks:
        """Make this the fork server ``ServerProcess`` uses."""
        global _active
        _active = self
        return self

    def can_fork(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether ``argv`` with ``env`` runs as a fork: the stock ``vllm`` under the fork server's
        environment (variables read only when used aside)."""
        if not argv or argv[0] != VLLM:
            return False
        ours = {k: v for k, v in env.items() if k not in READ_WHEN_USED}
        return ours == {k: v for k, v in self.env.items() if k not in READ_WHEN_USED}

    def start(
        self, argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path | None = None
    ) -> ForkedProcess:
        """``argv`` as a fork in a session of its own, its output in ``stdout`` (and ``stderr``, or the same
        file), in this process's working directory."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._launch()
            assert self._proc is not None and self._proc.stdin is not None
            self._next_id += 1
            case_id = self._next_id
            case = {"id": case_id, "argv": list(argv), "env": dict(env), "cwd": os.getcwd(),
                    "stdout": str(stdout), "stderr": str(stderr or stdout)}  # fmt: skip
            self._proc.stdin.write((json.dumps(case) + "\n").encode())
            self._proc.stdin.flush()
            proc = self._proc
            while case_id not in self._answers:
                if proc.poll() is not None and case_id not in self._answers:
                    raise RuntimeError(f"the vllm fork server exited ({proc.returncode}) starting {argv}")
                self._changed.wait(1.0)
            pid = self._answers.pop(case_id)
            self._children.add(pid)
        return ForkedProcess(self, pid, argv)

    def run(
        self, *args: str, env: Mapping[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """``vllm *args`` to its end (killed after ``timeout`` s), its output captured."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="vllm_fork_") as directory:
            out, err = Path(directory) / "stdout", Path(directory) / "stderr"
            child = self.start([VLLM, *args], env if env is not None else self.env, out, err)
            try:
                code = child.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                code = child.wait()
            return subprocess.CompletedProcess(
                ["vllm", *args], code, out.read_text(errors="replace"), err.read_text(errors="replace")
            )

    def close(self) -> None:
        global _active
        if _active is self:
            _active = None
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # --- internals

    def _launch(self) -> None:
        """The fork server, ready (called with the lock held)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
        )
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the vllm fork server exited ({proc.wait()}) before it was ready")
        spare_from_watches(proc.pid)
        self._proc = proc
        threading.Thread(target=self._read, args=(proc,), name="vllm-fork-server", daemon=True).start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            message = json.loads(line)
            with self._lock:
                if "id" in message:
                    self._answers[message["id"]] = message["pid"]
                else:
                    self._exits[message["pid"]] = message["returncode"]
                self._changed.notify_all()
        with self._lock:  # the fork server is gone: its children's ends are no longer reported
            self._changed.notify_all()

    def _returncode(self, pid: int) -> int | None:
        with self._lock:
            if pid in self._exits:
                return self._exits[pid]
            if self._proc is not None and self._proc.poll() is None:
                return None
        # its fork server is gone (its children were adopted and reaped by another): alive or not
        return None if _alive(pid) else -signal.SIGKILL

    def _wait_exit(self, pid: int, timeout: float | None) -> bool:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                if self._proc is None or self._proc.poll() is not None:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(0.5 if left is None else min(left, 0.5))
        if pid in self._exits:
            return True
        while _alive(pid):  # fork server gone
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True


def _alive(pid: int) -> bool:
    process = ProcessId.of(pid)
    return process is not None and process.alive()


if __name__ == "__main__":
    _serve()
