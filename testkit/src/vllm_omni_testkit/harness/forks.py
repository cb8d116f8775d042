"""Starts Python command lines (``vllm``, servers included, ``python -m``, ``python script.py``) as forks of
one process that imported vLLM once.

Every ``vllm serve`` a test starts spends about seven seconds of CPU importing vLLM, torch, transformers
and diffusers before it reads its first argument, and so does every ``python -m`` (Dynamo's frontend and
workers, the GPU check's driver) and engine script (``tests/helpers.py``: ``run_result_script``) that
imports them; the suite starts dozens. A :class:`VllmForks` keeps one process (the *fork server*) that
imported them once, and starts each command line as a fork of it: its own session, pid, environment,
working directory, output files and exit status, running what a fresh interpreter would run as its
``__main__`` and ending as the interpreter ends a script (threads joined, ``atexit`` handlers run, an
uncaught Ctrl-C re-raised as the signal). What forks (:func:`entry`):

- the stock console script (``bin/vllm``) and ``python /abs/path/script.py``: run with ``runpy.run_path``,
  ``sys.argv`` as given and ``sys.path[0]`` the script's real directory, as ``python script.py`` sets
  them (so that multiprocessing's spawned children start as a user's would);
- ``python -m MODULE``: ``runpy.run_module(alter_sys=True)``, ``sys.argv[0]`` the module's file and
  ``sys.path[0]`` the working directory, as ``python -m`` sets them. A module the fork server has
  already imported under its own name would run beside that copy: that fork execs a fresh interpreter
  in place (same pid, session and files).

``python`` means this interpreter (``sys.executable``) with no option before the script or ``-m``; any
other command line runs as a fresh process. The fork server loads no vLLM plugin and imports nothing of
Dynamo: each child loads ours from its entry point, as a fresh process does. A fork reseeds what a
process of its own seeds afresh (``random``, numpy's and torch's global generators, multiprocessing's
authkey); the hash seed stays the fork server's.

A command line forks only where its environment equals the fork server's, but for variables nothing
reads at import (``READ_WHEN_USED`` and ``READ_WHEN_USED_PREFIXES``) and those the fork server's own
imports set, where it holds what they set (``SET_BY_IMPORTS``: the test process's environment carries
them once it imported vLLM): what is imported depends on the environment (``VLLM_PLUGINS``,
``PYTHONPATH``, thread settings read when a library loads); any other runs as a fresh process. Tests that
check how a user's process starts or stops (tests/test_stops.py) give their servers environments of their
own, so they run fresh.

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

from vllm_omni_plugin.processes import ProcessId, run_exit_functions
from vllm_omni_testkit.harness.leaks import spare_from_watches

PRELOADED = (
    "vllm",  # first, as a fresh `vllm` imports it: vllm.env_override sets variables before torch reads them
    "torch",
    "transformers",
    "diffusers",
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.cli.openai",
    "vllm.entrypoints.cli.benchmark.main",
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.async_llm",
    # what an omni API server imports once it resolves its deployment (diffusers' model and pipeline
    # base classes, which bring peft: about 500 modules): third-party, no device touched at import
    "peft",
    "diffusers.models.modeling_utils",
    "diffusers.pipelines.pipeline_utils",
)
"""What the fork server imports: the costly part of every ``vllm`` start (no plugin among them)."""
READ_WHEN_USED = frozenset({
    "VLLM_OMNI_HOLD_DIR", "VLLM_OMNI_TEST_HOOKS", "VLLM_OMNI_FAULT_SEED",  # the test seam's
    "VLLM_LOG_STATS_INTERVAL",  # vllm.envs reads it when the engine logs its stats
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",  # read where the API server adds its routes and serving classes
    # vllm.envs reads it when an engine is made (LLMEngine, the CPU platform's config check); vLLM caches
    # its variables only once an engine core has started (enable_envs_cache), checked in _check_preloaded
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_USE_V2_MODEL_RUNNER",  # likewise: vllm.envs reads it where a VllmConfig is made
    "RAY_ADDRESS",  # ray.init
    # pytest sets it to each test phase's name, so it differs from the fork server's in every test but the
    # first: only test utilities read it, when called (Ray's is_in_test, not called at import, asks whether
    # it is set, and it is, in every process a test starts)
    "PYTEST_CURRENT_TEST",
    # torch's cache_dir() reads it at each call (and sets it where unset; vLLM sets it for each compiled
    # model); what torch keeps of it from its import, whether a compiler bisection is under way (files in it),
    # is False in every test's
    "TORCHINDUCTOR_CACHE_DIR",
    # vllm.plugins reads it when plugins load: the general ones where a command line starts (vLLM's CLI,
    # an engine), the platform ones where the platform is resolved; the fork server loads no general
    # plugin and no platform plugin is installed, so what it resolved is what any value gives (both
    # checked in _check_preloaded)
    "VLLM_PLUGINS",
})  # fmt: skip
"""Variables that may differ between a fork and the fork server: nothing imported reads them at import."""
SET_BY_IMPORTS = (
    # vllm.env_override, the first module vLLM imports (the first the fork server imports): no module the
    # fork server imports reads them before it sets them
    "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_COMPILE_THREADS", "TRITON_CACHE_AUTOTUNING",
    "TILELANG_CLEANUP_TEMP_FILES",
    # cv2 prepends its bundled libraries' folder, for its subprocesses (the dynamic linker read the variable
    # when the process started): allowed where the folders it adds do not exist, as ld.so skips them
    "LD_LIBRARY_PATH",
)  # fmt: skip
"""Variables the fork server's own imports set in its environment, as they do in every process that imports
them: the test process's environment carries them once it imported vLLM. A fork's may hold the fork
server's value of one from before its imports or the one they set (``_environ_after_imports``)."""
READ_WHEN_USED_PREFIXES = ("DYN_",)
"""Prefixes of such variables: Dynamo's (its Rust runtime and our Dynamo modules read them when a worker or
frontend starts); nothing the fork server imports reads them, and it imports nothing of Dynamo (checked
in ``_check_preloaded``)."""

VLLM = str(Path(sys.executable).parent / "vllm")
"""The stock console script this environment runs (what forks)."""

_active: VllmForks | None = None


def active_forks() -> VllmForks | None:
    """The session's fork server (``ServerProcess`` and ``run_to_end`` start command lines through it
    where they can)."""
    return _active


def run_to_end(
    argv: Sequence[str], env: Mapping[str, str], timeout: float, cwd: Path | str | None = None
) -> subprocess.CompletedProcess[str]:
    """``argv`` to its end with its output captured, as ``subprocess.run`` runs it (``TimeoutExpired``
    after ``timeout`` s): a fork of the session's fork server where it can be one, else a fresh process."""
    forks = active_forks()
    if forks is not None and forks.can_fork(argv, env):
        return forks.complete(argv, env, timeout, cwd)
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=dict(env), cwd=cwd)


def read_when_used(name: str) -> bool:
    """Whether the variable ``name`` may differ between a fork and the fork server."""
    return name in READ_WHEN_USED or name.startswith(READ_WHEN_USED_PREFIXES)


def entry(argv: Sequence[str]) -> tuple[str, str] | None:
    """What a fork of ``argv`` runs as its ``__main__``: ``("script", PATH)`` (the stock ``vllm``, or
    ``python PATH`` for an absolute PATH of a ``.py`` file) or ``("module", NAME)`` (``python -m NAME``);
    None where ``argv`` is anything else (another program or interpreter, an interpreter option), which
    runs fresh."""
    if not argv:
        return None
    if argv[0] == VLLM:
        return "script", VLLM
    if argv[0] != sys.executable or len(argv) < 2:
        return None
    if argv[1] == "-m":
        name = argv[2] if len(argv) > 2 else ""
        return ("module", name) if name and all(p.isidentifier() for p in name.split(".")) else None
    path = argv[1]
    if path.endswith(".py") and os.path.isabs(path) and os.path.isfile(path):
        return "script", path
    return None


# --- the fork server --------------------------------------------------------------------------------------


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(case: dict[str, Any], own: Sequence[int], main_path: str | None) -> None:
    """In the fork: become the command line ``case`` names, and end as the interpreter ends; ``own``:
    the fork server's descriptors beyond the standard three, closed here; ``main_path``: the fork
    server's own ``sys.path[0]`` (None where Python adds none: ``-P``), which the command line's
    replaces."""
    import runpy
    import tempfile

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
        argv = list(case["argv"])
        what = entry(argv)
        if what is None or (what[0] == "module" and _imported(what[1])):
            os.execvp(argv[0], argv)  # what no fork runs as a fresh process would: run fresh, in place
        kind, target = what
        tempfile.tempdir = None  # read from TMPDIR again
        _reseed()
        python = argv if argv[0] == sys.executable else [sys.executable, *argv]
        sys.orig_argv = python
        if main_path is not None:  # sys.path[0] as python sets it (-P: none)
            with contextlib.suppress(ValueError):
                sys.path.remove(main_path)
            sys.path.insert(0, os.getcwd() if kind == "module" else os.path.dirname(os.path.realpath(target)))
        try:
            if kind == "module":
                sys.argv = ["-m", *python[3:]]  # runpy sets [0] to the module's file, as python does
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.argv = python[1:]
                runpy.run_path(target, run_name="__main__")
            status = 0
        except SystemExit as stop:
            status = _exit_status(stop.code)
        except KeyboardInterrupt as stop:
            _print_uncaught(stop)
            interrupted = True
        except BaseException as error:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
            _print_uncaught(error)
            status = 1
        run_exit_functions()  # what the interpreter runs at exit, in order
        if interrupted:  # as CPython ends on an uncaught KeyboardInterrupt: killed by the signal
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - the fork could not become the command line: say why
        import traceback

        traceback.print_exc()
    finally:
        os._exit(status)


def _imported(name: str) -> bool:
    """Whether ``python -m name`` would run a module the fork server imported under its own name (runpy
    warns of that): a package's ``__main__``, or the module itself."""
    module = sys.modules.get(name)
    return f"{name}.__main__" in sys.modules or (module is not None and not hasattr(module, "__path__"))


def _reseed() -> None:
    """What a fresh process seeds from the system's entropy, and a fork would share with the fork server
    and its siblings: the global generators of ``random``, numpy and torch, multiprocessing's authkey."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].default_generator.seed()
    if "multiprocessing.process" in sys.modules:
        sys.modules["multiprocessing.process"].current_process().authkey = os.urandom(32)


def _print_uncaught(error: BaseException) -> None:
    """``error``'s traceback as the interpreter prints it, from the command line's own frames (not the
    fork server's or runpy's)."""
    import runpy
    import traceback

    ours = (_child.__code__.co_filename, runpy.run_path.__code__.co_filename)  # runpy's: "<frozen runpy>"
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb)


def _check_preloaded() -> None:
    """What ``READ_WHEN_USED`` assumes of the fork server, checked once it imported ``PRELOADED``: vLLM
    still reads its variables when used (its cache is enabled only where an engine core starts), nothing
    of Dynamo is imported (its variables are read where a runtime starts), and no vLLM plugin is loaded
    nor any platform plugin installed (``VLLM_PLUGINS`` picks among them where they load)."""
    envs = sys.modules.get("vllm.envs")
    if envs is not None and hasattr(envs.__getattr__, "cache_clear"):
        raise RuntimeError("vllm.envs caches its variables in the fork server: forks would not read theirs")
    dynamo = sorted(name for name in sys.modules if name.split(".")[0] == "dynamo")
    if dynamo:
        raise RuntimeError(f"the fork server imported Dynamo ({dynamo[0]}): forks would not read DYN_*")
    from importlib.metadata import entry_points

    plugins = sys.modules.get("vllm.plugins")
    loaded = plugins is not None and getattr(plugins, "plugins_loaded", False)
    if loaded or entry_points(group="vllm.platform_plugins"):
        raise RuntimeError("the fork server loaded vLLM plugins, or a platform plugin is installed: forks "
                           "would not read VLLM_PLUGINS")  # fmt: skip


def _serve(main_path: str | None) -> None:
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    _check_preloaded()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through the wakeup fd
    out = sys.stdout

    def say(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    say({"ready": True, "environ": {k: os.environ.get(k) for k in SET_BY_IMPORTS}})
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
                    _child(case, (wake_read, wake_write), main_path)
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
        self._imported_environ: dict[str, str | None] = {}

    def activate(self) -> VllmForks:
        """Make this the fork server ``ServerProcess`` uses."""
        global _active
        _active = self
        return self

    def can_fork(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether ``argv`` with ``env`` runs as a fork: a command line a fork runs (``entry``) under the
        fork server's environment (variables read only when used aside, and those its imports set where
        ``env`` holds what they set: that asks the fork server, started here where it has not been)."""
        if entry(argv) is None:
            return False

        def compared(variables: Mapping[str, str]) -> dict[str, str]:
            return {k: v for k, v in variables.items() if not read_when_used(k) and k not in SET_BY_IMPORTS}

        if compared(env) != compared(self.env):
            return False
        moved = [k for k in SET_BY_IMPORTS if env.get(k) != self.env.get(k)]
        if not moved:
            return True
        imported = self._environ_after_imports()
        if any(env.get(k) != imported.get(k) for k in moved):
            return False
        paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
        known = set(self.env.get("LD_LIBRARY_PATH", "").split(":"))
        return not any(os.path.isdir(p) for p in paths if p not in known)

    def start(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdout: Path,
        stderr: Path | None = None,
        cwd: Path | str | None = None,
    ) -> ForkedProcess:
        """``argv`` as a fork in a session of its own, its output in ``stdout`` (and ``stderr``, or the same
        file), in ``cwd`` (default: this process's working directory)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._launch()
            assert self._proc is not None and self._proc.stdin is not None
            self._next_id += 1
            case_id = self._next_id
            case = {"id": case_id, "argv": list(argv), "env": dict(env), "cwd": os.path.abspath(cwd or "."),
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
        code, out, err, _ = self._to_end([VLLM, *args], env if env is not None else self.env, timeout, None)
        return subprocess.CompletedProcess(["vllm", *args], code, out, err)

    def complete(
        self, argv: Sequence[str], env: Mapping[str, str], timeout: float, cwd: Path | str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` (one ``can_fork`` allows) to its end as a fork, as ``subprocess.run`` with
        ``capture_output`` and ``text`` runs it: after ``timeout`` s its session is killed and
        ``TimeoutExpired`` raised, with the output so far."""
        code, out, err, timed_out = self._to_end(argv, env, timeout, cwd)
        if timed_out:
            raise subprocess.TimeoutExpired(list(argv), timeout, output=out, stderr=err)
        return subprocess.CompletedProcess(list(argv), code, out, err)

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

    def _environ_after_imports(self) -> dict[str, str | None]:
        """The fork server's ``SET_BY_IMPORTS`` variables once it imported ``PRELOADED`` (started here
        where it has not been)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._launch()
            return dict(self._imported_environ)

    def _to_end(
        self, argv: Sequence[str], env: Mapping[str, str], timeout: float, cwd: Path | str | None
    ) -> tuple[int, str, str, bool]:
        """``argv`` as a fork to its end, or its session killed after ``timeout`` s: its exit status, its
        output and error output, whether it timed out."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="vllm_fork_") as directory:
            out, err = Path(directory) / "stdout", Path(directory) / "stderr"
            child = self.start(argv, env, out, err, cwd)
            timed_out = False
            try:
                code = child.wait(timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                code = child.wait()
            return code, out.read_text(errors="replace"), err.read_text(errors="replace"), timed_out

    def _launch(self) -> None:
        """The fork server, ready (called with the lock held)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
        )
        assert proc.stdout is not None
        while True:  # past what its imports may print
            ready = proc.stdout.readline()
            if not ready:
                raise RuntimeError(f"the vllm fork server exited ({proc.wait()}) before it was ready")
            if ready.startswith(b'{"ready": true'):
                break
        self._imported_environ = json.loads(ready)["environ"]
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
    _serve(None if sys.flags.safe_path else sys.path[0])
