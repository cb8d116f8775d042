"""Stopping a served deployment the ways users and container runtimes do, with requests in flight: nothing
stays behind, neither a process of the deployment nor a ``/dev/shm`` segment (ours, vLLM's,
multiprocessing's) nor anything in its temp directory (its runtime directory with every IPC endpoint:
``runtime_dir.py``), and the main process exits 0 after SIGTERM or SIGINT. Each server runs as a user's
does (``user_like_env``: a temp directory of its own, the default runtime directory resolution). A
SIGKILL (of the main process alone, or of the whole group) leaves what the dead processes owned for the
next start's sweep, which is checked too, and which spares a live server beside it."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from vllm_omni_plugin.processes import SHM_DIR
from vllm_omni_plugin.testing.harness.holds import Hold
from vllm_omni_plugin.testing.harness.leaks import LeakWatch
from vllm_omni_plugin.testing.harness.server import (
    ServerProcess,
    bin_script,
    free_port,
    left_in_temp,
    user_like_env,
)

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parent.parent
DEPLOY = str(REPO / "deploy" / "tiny_glm_image_cpu.yaml")
GENERATIONS = "/v1/images/generations"
DIT_STEPS = 20
"""The DiT-long requests are held in the DiT (its ``dit.step`` hold point) until the server is signalled,
then drain well inside the 30 s drain timeout (they share one DiT batch)."""
DIT_LONG = [
    {"prompt": "a slow painting", "size": "64x64", "num_inference_steps": DIT_STEPS, "seed": 1},
    {"prompt": "a slow painting", "size": "64x64", "num_inference_steps": DIT_STEPS, "seed": 2},
]
AR_LONG = [
    {"prompt": "a big painting", "size": "512x512", "num_inference_steps": 2, "seed": 3},
    {"prompt": "a big painting", "size": "512x512", "num_inference_steps": 2, "seed": 4},
]
IN_FLIGHT = DIT_LONG + AR_LONG


class Served:
    """A served deployment, its watch (its processes and the segments they map) and requests in flight."""

    def __init__(self, model: Path, log_dir: Path, env: dict[str, str] | None = None) -> None:
        port = free_port()
        self.server = ServerProcess(
            [bin_script("vllm"), "serve", str(model), "--omni", "--deploy-config", DEPLOY,
             "--port", str(port), "--host", "127.0.0.1", "--image-max-inference-steps", str(DIT_STEPS)],
            port=port, log_path=log_dir / "server.log", env=env or user_like_env(),
        )  # fmt: skip
        self.server.start()
        assert self.server.proc is not None
        self.pid = self.server.proc.pid
        self.watch = LeakWatch(root=self.pid, interval=0.1).start()
        self.responses: list[int | str] = []
        self.threads: list[threading.Thread] = []
        try:
            self.server.wait_ready(timeout=300)
        except BaseException:
            self.finish()
            raise

    def send_in_flight(self) -> Hold:
        """The requests of ``IN_FLIGHT``, returning once every one of them is in a stage and both stages
        are working: the DiT-long ones first, held in the DiT from its first step until the test
        releases the returned hold, then the AR-long ones. Nothing leaves the held DiT, so the counts
        waited for are sure to come however slow the machine is. A request the server has not yet read
        does not count: the model's processor of a big image runs in the API process and holds up its
        event loop, and a connection whose request was not read when the server stops is closed
        unanswered."""

        def send(body: dict) -> None:
            try:
                self.responses.append(
                    httpx.post(self.server.base_url + GENERATIONS, json=body, timeout=300).status_code
                )
            except httpx.HTTPError as exc:
                self.responses.append(type(exc).__name__)

        def start(bodies: list[dict]) -> None:
            threads = [threading.Thread(target=send, args=(b,), daemon=True) for b in bodies]
            self.threads += threads
            for thread in threads:
                thread.start()

        def wait_until(busy: Callable[[int, int], bool]) -> None:
            deadline = time.monotonic() + 600
            while True:
                stages = httpx.get(self.server.base_url + "/health", timeout=30).json()["stages"]
                if busy(*(stages[s]["replicas"][0]["inflight"] for s in ("0", "1"))):
                    return
                assert time.monotonic() < deadline, stages
                time.sleep(0.01)

        hold = self.server.hold("dit.step")
        start(DIT_LONG)
        hold.wait(alive=self.server.alive)
        wait_until(lambda ar, dit: dit >= len(DIT_LONG))
        start(AR_LONG)
        wait_until(lambda ar, dit: ar + dit >= len(IN_FLIGHT))
        return hold

    def wait_main(self, timeout: float = 120) -> int:
        assert self.server.proc is not None
        return self.server.proc.wait(timeout)

    def left(self, grace: float = 30.0) -> tuple[dict[int, str], list[str]]:
        """Processes of the deployment still running and segments still there, after up to ``grace`` s."""
        self.watch.stop()
        left = self.watch.leftovers(grace)
        return left.processes, left.segments

    def temp_left(self) -> list[str]:
        """What is in the server's temp directory (torch's compile cache aside)."""
        return left_in_temp(self.server.env)

    def runtime_dir(self) -> str:
        """The name of the server's runtime directory in its temp directory."""
        (name,) = [n for n in os.listdir(self.server.env["TMPDIR"]) if n.startswith(f"vllm-omni-{self.pid}-")]
        return name

    def finish(self) -> None:
        """Whatever happened: stop what is left (the guard would report it otherwise)."""
        self.server.stop()
        self.watch.stop()
        left = self.watch.leftovers()
        self.watch.clean(left)
        for thread in self.threads:
            thread.join(60)
        temp = self.server.env["TMPDIR"]
        if os.path.isdir(temp) and not any(n.startswith("vllm-omni-") for n in os.listdir(temp)):
            shutil.rmtree(temp, ignore_errors=True)  # not while a neighbour's runtime directory is in it


@pytest.fixture
def served(tiny_glm_image: Path, tmp_path: Path):
    deployment = Served(tiny_glm_image, tmp_path)
    try:
        yield deployment
    finally:
        deployment.finish()


def test_ctrl_c_sigint_to_the_group(served: Served) -> None:
    hold = served.send_in_flight()
    os.killpg(served.pid, signal.SIGINT)
    hold.release()
    assert served.wait_main() == 0
    assert served.left() == ({}, [])
    assert served.temp_left() == []


def test_sigterm_to_the_main_process(served: Served) -> None:
    hold = served.send_in_flight()
    os.kill(served.pid, signal.SIGTERM)
    hold.release()  # the DiT-long requests finish while the server drains
    assert served.wait_main() == 0
    for thread in served.threads:
        thread.join(60)
    assert served.responses == [200] * len(IN_FLIGHT)  # drained, not dropped
    assert served.left() == ({}, [])
    assert served.temp_left() == []


def test_sigterm_to_the_group_then_sigkill_of_the_group_once_main_is_gone(served: Served) -> None:
    """As container runtimes stop a container: nothing may rely on a process outliving the main one."""
    hold = served.send_in_flight()
    os.killpg(served.pid, signal.SIGTERM)
    hold.release()
    assert served.wait_main() == 0
    os.killpg(served.pid, signal.SIGKILL)  # the group, at once: resource tracker and stragglers included
    assert served.left() == ({}, [])
    assert served.temp_left() == []


def test_sigkill_of_the_main_process_alone_then_the_next_start_sweeps(
    served: Served, tiny_glm_image: Path, tmp_path: Path
) -> None:
    served.send_in_flight()  # the hold dies with its holder
    runtime = served.runtime_dir()
    assert any(n.startswith(f"{runtime}/ar0-0/") for n in served.temp_left()), (
        "expected the engine's endpoints"
    )
    os.kill(served.pid, signal.SIGKILL)
    assert served.wait_main() == -signal.SIGKILL
    processes, segments = served.left()
    assert processes == {}  # the stage processes noticed their parent's death and exited
    # what the main process itself owned stays for the next start's sweep: its pool and runtime directory
    assert all(name.startswith(f"vllm_omni_{served.pid}_") for name in segments), segments
    assert runtime in served.temp_left()
    following = Served(tiny_glm_image, tmp_path / "next", env=served.server.env)
    try:
        assert [n for n in segments if os.path.exists(os.path.join(SHM_DIR, n))] == []
        assert runtime not in served.temp_left()
        assert [n for n in served.temp_left() if "/" not in n] == [following.runtime_dir()]
    finally:
        following.finish()
    assert following.temp_left() == []


def test_sigkill_of_the_group_then_a_new_start_sweeps_it_and_spares_a_live_server_beside(
    served: Served, tiny_glm_image: Path, tmp_path: Path
) -> None:
    """The whole group SIGKILLed (a container runtime's hard stop): the next start in the same temp
    directory removes the dead server's runtime directory, not the one of a server still running beside
    it, whose own stop then removes its own and leaves the new one alone."""
    beside = Served(tiny_glm_image, tmp_path / "beside", env=served.server.env)
    following: Served | None = None
    try:
        dead, alive = served.runtime_dir(), beside.runtime_dir()
        os.killpg(served.pid, signal.SIGKILL)
        assert served.wait_main() == -signal.SIGKILL
        processes, segments = served.left()
        assert processes == {}
        # nobody lived to unlink the group's segments (its pools, vLLM's message queues) or its runtime
        # directory, which lists the segments its engine mapped: the next start's sweeps remove them
        assert segments and all(name.startswith(("vllm_omni_", "psm_")) for name in segments), segments
        assert dead in served.temp_left()
        following = Served(tiny_glm_image, tmp_path / "next", env=served.server.env)
        new = following.runtime_dir()
        assert [n for n in segments if os.path.exists(os.path.join(SHM_DIR, n))] == []
        assert [n for n in served.temp_left() if "/" not in n] == sorted([alive, new])
        response = httpx.post(
            beside.server.base_url + GENERATIONS, json={"prompt": "a fox", "size": "64x64"}, timeout=300
        )
        assert response.status_code == 200  # the server beside still serves
        assert beside.server.stop(how=signal.SIGTERM) == 0
        assert [n for n in served.temp_left() if "/" not in n] == [new]
    finally:
        beside.finish()
        if following is not None:
            following.finish()
    assert served.temp_left() == []
