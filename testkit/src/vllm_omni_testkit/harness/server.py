"""Start and stop real server processes for tests and benchmarks.

A server runs in its own process group with its output in a log file; ``stop()`` sends SIGINT (the
graceful path users take), then SIGKILL to the whole group, so no engine process outlives a test.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.forks import ForkedProcess, active_forks
from vllm_omni_testkit.holds import Hold, HoldPoints

CPU_TEST_ENV: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
"""Environment every test process gets: CPU platform, offline, one OpenMP thread.

No ``VLLM_CPU_KVCACHE_SPACE``: on CPU it overrides ``kv_cache_memory_bytes``, which every engine we
start sets explicitly (a few MiB).
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bin_script(name: str) -> str:
    """A console script of the running interpreter's environment (e.g. the stock ``vllm``)."""
    return str(Path(sys.executable).parent / name)


_frozen_environ: dict[str, str] | None = None


def freeze_test_environment() -> None:
    """Take this process's environment as it is now for every process :func:`cpu_test_env` makes one
    for. A test run freezes it at its start: what in-process engines and Ray's driver later write into
    pytest's own environment (vLLM's CPU settings, ``LD_PRELOAD``, ``PYTHONBREAKPOINT``) is theirs, not
    what the processes a test starts inherit (a user's would not), and it would keep those from
    starting as forks (``forks.py``)."""
    global _frozen_environ
    _frozen_environ = dict(os.environ)


def cpu_test_env(extra: Mapping[str, str] | None = None, drop: Sequence[str] = ()) -> dict[str, str]:
    """The environment of a process a test starts: this process's (as frozen at the run's start, where
    it was: :func:`freeze_test_environment`), the CPU test settings, then ``extra``, less ``drop``."""
    base = _frozen_environ if _frozen_environ is not None else os.environ
    env = {**base, **CPU_TEST_ENV, **(extra or {})}
    for key in drop:
        env.pop(key, None)
    return env


def user_like_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a user's server has, for the tests that check what a stop leaves: the CPU test
    settings with a temp directory of the server's own (fresh, and short: a unix socket's path may not
    pass 107 bytes), and neither the suite's ``VLLM_RPC_BASE_PATH`` nor its ``UCX_MODULES``, so the server
    resolves its runtime directory and loads UCX as it would on a user's machine."""
    temp = tempfile.mkdtemp(prefix="s", dir=os.environ.get("TMPDIR"))
    return cpu_test_env(
        {**(extra or {}), "TMPDIR": temp}, drop=("VLLM_RPC_BASE_PATH", "XDG_RUNTIME_DIR", "UCX_MODULES")
    )


TEMP_CACHES = ("torchinductor_",)
"""Names in a temp directory that are caches meant to outlive a process (torch's compile cache)."""


def left_in_temp(env: Mapping[str, str]) -> list[str]:
    """What is in a server's temp directory (``TMPDIR`` of ``env``) besides caches, recursively."""
    temp = env["TMPDIR"]
    left = []
    for root, dirs, files in os.walk(temp):
        if root == temp:
            dirs[:] = [d for d in dirs if not d.startswith(TEMP_CACHES)]
        left.extend(os.path.relpath(os.path.join(root, name), temp) for name in (*dirs, *files))
    return sorted(left)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie main process (not yet reaped) still counts; only live members matter here.
    return any(_pgid_of(pid) == pgid for pid in _pids() if pid != pgid)


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def metric_value(text: str, sample: str, /, **labels: str) -> float:
    """The sum of the Prometheus samples named ``sample`` in ``text`` (a /metrics page) whose labels
    include ``labels`` (0 when none does)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith((sample + "{", sample + " ")):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_denoising(metric: Callable[[str], float], since: float, steps: int, timeout: float = 120.0) -> None:
    """Until the diffusion stages have run more than none and at most half of ``steps`` denoising steps
    past ``since`` (``omni_diffusion_denoise_steps_total`` read before the request was sent; ``metric``
    reads a sample of the server's /metrics): the request of ``steps`` steps is being denoised now, far
    from its end. Only the steps count proves that; a request counted in flight in a stage may be
    waiting, or already finishing."""
    deadline = time.monotonic() + timeout
    while True:
        done = metric("omni_diffusion_denoise_steps_total") - since
        if 0 < done <= steps // 2:
            return
        assert done <= steps // 2, f"{done:.0f} of {steps} steps were done before a report came"
        assert time.monotonic() < deadline, "no denoising step was reported"
        time.sleep(0.02)


def wait_for_metric(
    metric: Callable[[str], float],
    sample: str,
    expected: float,
    *,
    at_least: bool = False,
    timeout: float = 30.0,
) -> None:
    """Until ``metric(sample)`` is ``expected`` (or more, ``at_least``): what remote replicas report
    reaches /metrics a moment after the answer."""
    deadline = time.monotonic() + timeout
    while (value := metric(sample)) != expected and not (at_least and value > expected):
        assert time.monotonic() < deadline, f"{sample} is {value}, not {'at least ' * at_least}{expected}"
        time.sleep(0.1)


class ServerProcess:
    def __init__(
        self,
        argv: Sequence[str],
        *,
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.argv = list(argv)
        self.port = port
        self.host = host
        self.log_path = log_path
        self.holds = HoldPoints()
        """Hold points of this deployment (``vllm_omni_testkit.holds``, reached through the product's
        ``vllm_omni_plugin.test_hooks``)."""
        self.env = {**(dict(env) if env is not None else cpu_test_env()), **self.holds.env}
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        """The main process: a fork of the session's fork server where it can be (``forks.py``)."""

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        forks = active_forks()
        if forks is not None and forks.can_fork(self.argv, self.env):
            self.proc = forks.start(self.argv, self.env, self.log_path)
            return self
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        log.close()
        return self

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def metric(self, sample: str, /, **labels: str) -> float:
        """See ``metric_value``: one sample (or a sum) of this server's /metrics."""
        return metric_value(http_client.get(self.base_url + "/metrics", timeout=30).text, sample, **labels)

    def wait_denoising(self, since: float, steps: int, timeout: float = 120.0) -> None:
        """See the module's ``wait_denoising``, on this server's /metrics."""
        wait_denoising(self.metric, since, steps, timeout)

    def wait_ready(self, timeout: float = 300.0, path: str = "/health", http: Any = http_client) -> None:
        """Until ``path`` answers 200; ``http`` is anything with httpx's ``get`` (e.g. a client that
        runs inside the server's network namespace)."""
        self.wait_until(lambda: http.get(self.base_url + path, timeout=2.0).status_code == 200, timeout)

    def wait_for_log(self, text: str, timeout: float = 300.0) -> None:
        """Until the server's log contains ``text`` (servers without HTTP, e.g. headless workers)."""
        self.wait_until(lambda: text in self.log_text(), timeout)

    def wait_until(self, ready: Callable[[], bool], timeout: float, *, stop: bool = True) -> None:
        """Until ``ready()``; at the timeout, the server is stopped (``stop``: a server other tests share
        stays up for them) and TimeoutError says its log's tail."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} before it was ready; log tail:\n"
                    + self.log_text()[-4000:]
                )
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        if stop:
            self.stop()
        raise TimeoutError(f"server not ready after {timeout:.0f}s; log tail:\n" + self.log_text()[-4000:])

    def stop(self, grace: float = 30.0, how: signal.Signals = signal.SIGINT) -> int | None:
        """Stop the server (``how``: SIGINT to its group, as Ctrl-C; SIGTERM to its main process, as
        ``kill`` or systemd), then SIGKILL what is left of the group; the main process's exit status."""
        self.holds.release_all()  # held work would keep the graceful path waiting
        try:
            return self._stop(grace, how)
        finally:
            self.holds.remove()

    def hold(self, point: str) -> Hold:
        """Arm ``point`` (see ``vllm_omni_testkit.holds``); use as a context manager around the work it
        holds."""
        return self.holds.arm(point)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _stop(self, grace: float, how: signal.Signals = signal.SIGINT) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                if how == signal.SIGINT:
                    os.killpg(self.proc.pid, signal.SIGINT)
                else:
                    os.kill(self.proc.pid, how)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        # The server's helpers (e.g. multiprocessing's resource tracker, which unlinks shared memory)
        # finish after the main process: give them time before killing what is left of the group.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _group_alive(self.proc.pid):
            time.sleep(0.1)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers in the group
        except ProcessLookupError:
            pass
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            return None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def omni_server(
    model: Path,
    deploy: Path,
    log_path: Path,
    *extra: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
) -> Iterator[ServerProcess]:
    """``vllm serve MODEL --omni --deploy-config DEPLOY [EXTRA]`` on a free port of this host, in the CPU
    test environment (plus ``env``), ready; stopped on the way out."""
    port = free_port()
    argv = [bin_script("vllm"), "serve", str(model), "--omni", "--deploy-config", str(deploy),
            "--port", str(port), "--host", "127.0.0.1", *extra]  # fmt: skip
    with ServerProcess(argv, port=port, env=cpu_test_env(env), log_path=log_path) as server:
        server.wait_ready(timeout=timeout)
        yield server
