"""A Dynamo deployment on this host, for tests and benchmarks: Dynamo's real HTTP frontend and our
workers as processes, discovering each other through a folder (``file`` discovery), every plane on
loopback, in one namespace of their own.

Each process is a ``ServerProcess``: the frontend's ``port`` is its HTTP port; a worker's is its system
port (``DYN_SYSTEM_PORT``: ``/metrics`` with our counts, Dynamo's ``/health``), and its hold points are its
own (``ServerProcess.hold``). Each is a ``python -m`` in the suite's environment plus Dynamo's ``DYN_*``
variables, so it starts as a fork of the session's fork server (``forks.py``): vLLM, torch and diffusers
already imported.
"""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_omni_testkit.harness.leaks import LeakWatch
from vllm_omni_testkit.harness.server import ServerProcess, cpu_test_env, free_port

LOOPBACK = {
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_SYSTEM_HOST": "127.0.0.1",
}
"""Dynamo binds its planes to a non-loopback interface unless told otherwise."""


SYSTEM_PORTS = range(20000, 32768)
"""Dynamo 1.6 reads ``DYN_SYSTEM_PORT`` as an i16: a worker's system port must be below 32768 (the
ephemeral ports the kernel hands out start above it)."""


def free_system_port() -> int:
    """A free TCP port of ``SYSTEM_PORTS`` on loopback."""
    for port in random.sample(SYSTEM_PORTS, 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {SYSTEM_PORTS}")


def dynamo_missing() -> str | None:
    """Why Dynamo's runtime cannot run here (None: it can): tests skip with this."""
    try:
        from dynamo.llm import make_engine, register_model  # noqa: F401
        from dynamo.runtime import DistributedRuntime  # noqa: F401
    except ImportError as exc:
        return f"Dynamo's runtime is not installed ({exc.msg}): pip install 'vllm-omni-plugin[dynamo]'"
    return None


@dataclass
class DynamoSite:
    """Dynamo processes of one deployment: ``directory`` holds discovery and the logs."""

    directory: Path
    namespace: str = field(default_factory=lambda: f"omni-{uuid.uuid4().hex[:8]}")
    processes: list[ServerProcess] = field(default_factory=list)

    @classmethod
    @contextlib.contextmanager
    def running(cls, directory: Path) -> Iterator[DynamoSite]:
        """A site whose frontend is up; at the end, its processes stopped and nothing of them left
        (processes, shared memory), else AssertionError naming what was (then removed)."""
        watch = LeakWatch(only_new_processes=True).start()  # not what earlier tests' engines left
        site = cls(directory)
        frontend = site.frontend()
        try:
            frontend.wait_ready(path="/v1/models", timeout=120)
            yield site
        finally:
            site.stop()
            watch.stop()
            left = watch.leftovers(grace=30)
            watch.clean(left)
            assert not left, left.describe()

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        (self.directory / "discovery").mkdir(parents=True, exist_ok=True)
        return cpu_test_env(
            {
                "DYN_DISCOVERY_BACKEND": "file",
                "DYN_FILE_KV": str(self.directory / "discovery"),
                "DYN_REQUEST_PLANE": "tcp",
                "DYN_EVENT_PLANE": "zmq",
                "DYN_NAMESPACE": self.namespace,
                "DYN_LOG": "warn",
                **LOOPBACK,
                **(extra or {}),
            }
        )

    def frontend(self, name: str = "frontend") -> ServerProcess:
        """Dynamo's HTTP frontend (``base_url``: its OpenAI API), started."""
        port = free_port()
        argv = [sys.executable, "-m", "vllm_omni_plugin.dynamo.frontend", "--http-host", "127.0.0.1",
                "--http-port", str(port), "--namespace", self.namespace]  # fmt: skip
        # info: what it discovers and builds, which a test that waits for a model to be listed shows
        env = self.env({"DYN_LOG": "info,dynamo_llm::http=warn,dynamo_runtime::pipeline=warn"})
        return self._start(ServerProcess(argv, port=port, log_path=self.directory / f"{name}.log", env=env))

    def worker(
        self, model: Path | str, *flags: str, name: str, env: Mapping[str, str] | None = None
    ) -> ServerProcess:
        """``python -m vllm_omni_plugin.dynamo MODEL *flags``, started (``base_url``: its system port)."""
        port = free_system_port()
        system = {"DYN_SYSTEM_PORT": str(port), **(env or {})}
        argv = [sys.executable, "-m", "vllm_omni_plugin.dynamo", str(model), *flags]
        return self._start(
            ServerProcess(argv, port=port, log_path=self.directory / f"{name}.log", env=self.env(system))
        )

    def _start(self, process: ServerProcess) -> ServerProcess:
        self.processes.append(process)
        return process.start()

    def stop(
        self, processes: Sequence[ServerProcess] | None = None, how: signal.Signals = signal.SIGINT
    ) -> dict[str, int | None]:
        """Stop ``processes`` (default: all: the workers together, then the frontend) as users do
        (``how``: SIGINT to the group, as Ctrl-C; SIGTERM to the main process, as systemd or Kubernetes),
        each given its time to stop, side by side; each one's exit status, by its log file's name."""
        chosen = list(processes if processes is not None else self.processes)
        frontend = [p for p in chosen if p is self.processes[0]] if self.processes else []
        workers = [p for p in chosen if p not in frontend]
        statuses: dict[str, int | None] = {}

        def stop(process: ServerProcess) -> None:
            statuses[process.log_path.stem] = process.stop(how=how)

        stoppers = [threading.Thread(target=stop, args=(p,)) for p in workers]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join()
        for process in frontend:
            stop(process)
        return statuses

    def terminate(self, processes: Sequence[ServerProcess]) -> None:
        """Stop ``processes`` with SIGTERM, as systemd or Kubernetes stop them; AssertionError unless each
        one exits 0."""
        statuses = self.stop(processes, how=signal.SIGTERM)
        assert statuses and set(statuses.values()) == {0}, statuses
