"""Runs ``vllm`` command lines as forks of one process that imported vLLM's command line once.

Each command line is what the stock ``vllm`` console script runs (``vllm.entrypoints.cli.main.main`` with
``sys.argv``), in a child forked from a process that imported vLLM's command-line modules (about ten
seconds of CPU each time otherwise): its own process, exit status, stdout and stderr, and a traceback
printed as the interpreter prints one. The forking process loads no vLLM plugin itself, so each child
loads ours as the console script would. Command lines whose environment decides what is imported (another
``VLLM_PLUGINS``, a ``PYTHONPATH``) belong in a fresh ``vllm`` process instead.

Run as a script (``python tests/vllm_cli_forks.py``): one JSON object per line on stdin
(``{"args": [...], "env": {...}, "timeout": seconds}``), one per line on stdout (``returncode``,
``stdout``, ``stderr``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import IO, Any


def _child(case: dict[str, Any], out: IO[bytes], err: IO[bytes]) -> int:
    """In the fork: what the console script does, with this case's argv, environment and streams."""
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    os.environ.clear()
    os.environ.update(case["env"])
    sys.argv = ["vllm", *case["args"]]
    from vllm.entrypoints.cli.main import main

    try:
        code = main()
        status = 0 if code is None else int(code)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        import traceback

        traceback.print_exc()
        status = 1
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    return status


def _run(case: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                status = _child(case, out, err)
            finally:
                os._exit(status)
        deadline = time.monotonic() + float(case.get("timeout", 300))
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        return {
            "returncode": os.waitstatus_to_exitcode(status),
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace"),
        }


def _serve() -> None:
    # What vllm.entrypoints.cli.main.main imports lazily: the costly part of every ``vllm`` start.
    import vllm.entrypoints.cli.benchmark.main  # noqa: F401
    import vllm.entrypoints.cli.main  # noqa: F401
    import vllm.entrypoints.cli.openai  # noqa: F401
    import vllm.entrypoints.cli.serve  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_run(json.loads(line))), flush=True)


class VllmCliForks:
    """The test side: one forking process per test module (``close`` stops it)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[str]:
        """The forking process, ready. Started again by :meth:`run` where it is gone: a test that ends
        the processes its worker started (a leak guard's clean-up) may take it with them."""
        proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            text=True,
        )
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the vllm fork process exited ({proc.wait()}) before it was ready")
        return proc

    def run(
        self, *args: str, env: Mapping[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        if self.proc.poll() is not None:
            self._close_pipes()
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        case = {"args": list(args), "env": dict(env or self.env), "timeout": timeout}
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vllm fork process died ({self.proc.poll()}) running {args}")
        result = json.loads(line)
        return subprocess.CompletedProcess(
            ["vllm", *args], result["returncode"], result["stdout"], result["stderr"]
        )

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # it may be gone already
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


if __name__ == "__main__":
    _serve()
