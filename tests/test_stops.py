"""Stopping a served deployment the ways users and container runtimes do, with requests in flight, over
each connector (shared memory, NIXL, Mooncake): nothing stays behind, neither a process of the deployment
nor a ``/dev/shm`` segment (ours, vLLM's, multiprocessing's) nor anything in its temp directory (its
runtime directory with every IPC endpoint: ``runtime_dir.py``), and the main process exits 0 after SIGTERM
or SIGINT. Each server runs as a user's does (``user_like_env``: a temp directory of its own, the default
runtime directory resolution). A SIGKILL (of the main process alone, or of the whole group) leaves what
the dead processes owned for the next start's sweep, which is checked too, and which spares a live server
beside it. Each deployment's servers share one temp directory, so that every sweep meets the others'.

Two deployments: shared memory on both edges (the deploy file as it is), and the two network connectors
in one deployment, NIXL from the AR stage to the DiT and Mooncake's transfer engine from the DiT to the
API server, so that every stop meets what both of them hold (NIXL on both edges where Mooncake is not
installed)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from vllm_omni_plugin.processes import SHM_DIR, descendants, semaphores_of
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.leaks import LeakWatch
from vllm_omni_testkit.harness.network_deploy import network_connectors
from vllm_omni_testkit.harness.server import (
    ServerProcess,
    bin_script,
    free_port,
    left_in_temp,
    user_like_env,
)
from vllm_omni_testkit.holds import Hold

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy" / "tiny_glm_image_cpu.yaml"
DEPLOYMENTS = ("shared_memory", "nixl_then_mooncake")
"""Shared memory on both edges (the deploy file as it is, its default), and the network connectors
(``vllm_omni_testkit.harness.network_deploy``)."""
NETWORK_DEPLOY = """base_config: tiny_glm_image_cpu.yaml
{connectors}stages:
  - stage_id: 0
    output_connectors: {{to_stage_1: ar_to_dit}}
  - stage_id: 1
    input_connectors: {{from_stage_0: ar_to_dit}}
    output_connectors: {{to_stage_router: dit_to_router}}
"""
GENERATIONS = "/v1/images/generations"
DIT_STEPS = 20
"""The DiT-long requests are held in the DiT (its ``dit.step`` hold point) until the server is signalled,
then drain well inside the 30 s drain timeout (they share one DiT batch)."""
DIT_LONG = [
    {"prompt": "a slow painting", "size": "64x64", "num_inference_steps": DIT_STEPS, "seed": 1},
    {"prompt": "a slow painting", "size": "64x64", "num_inference_steps": DIT_STEPS, "seed": 2},
]
AR_LONG = [
    {"prompt": "a big painting", "size": "256x256", "num_inference_steps": 2, "seed": 3},
    {"prompt": "a big painting", "size": "256x256", "num_inference_steps": 2, "seed": 4},
]
IN_FLIGHT = DIT_LONG + AR_LONG


class Served:
    """A served deployment, its watch (its processes and the segments they map) and requests in flight.
    It starts at construction; :meth:`ready` waits for it (the servers of a test start side by side)."""

    def __init__(self, model: Path, deploy: Path, log_dir: Path, env: dict[str, str]) -> None:
        port = free_port()
        self.server = ServerProcess(
            [bin_script("vllm"), "serve", str(model), "--omni", "--deploy-config", str(deploy),
             "--port", str(port), "--host", "127.0.0.1", "--image-max-inference-steps", str(DIT_STEPS)],
            port=port, log_path=log_dir / "server.log", env=env,
        )  # fmt: skip
        self.server.start()
        assert self.server.proc is not None
        self.pid = self.server.proc.pid
        self.watch = LeakWatch(root=self.pid).start()
        self.responses: list[int | str] = []
        self.threads: list[threading.Thread] = []

    def ready(self) -> Served:
        # Up to three servers start side by side on the suite's two cores, next to the other worker's
        # tests: each gets the time of three starts.
        self.server.wait_ready(timeout=600)
        return self

    def send_in_flight(self, hold_ar: Hold | None = None) -> Hold:
        """The requests of ``IN_FLIGHT``, returning once every one of them is in a stage and both stages
        are working: the DiT-long ones first, held in the DiT from its first step until the test
        releases the returned hold, then the AR-long ones (held in the AR engine too where ``hold_ar``,
        not yet armed, is given: it is armed once the DiT-long ones have left the AR stage). Nothing leaves the held DiT, so the counts
        waited for are sure to come however slow the machine is. A request the server has not yet read
        does not count: the model's processor of a big image runs in the API process and holds up its
        event loop, and a connection whose request was not read when the server stops is closed
        unanswered."""

        def send(body: dict) -> None:
            try:
                self.responses.append(
                    http_client.post(self.server.base_url + GENERATIONS, json=body, timeout=300).status_code
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
                stages = http_client.get(self.server.base_url + "/health", timeout=30).json()["stages"]
                if busy(*(stages[s]["replicas"][0]["inflight"] for s in ("0", "1"))):
                    return
                assert time.monotonic() < deadline, stages
                time.sleep(0.01)

        hold = self.server.hold("dit.step")
        start(DIT_LONG)
        hold.wait(alive=self.server.alive)
        wait_until(lambda ar, dit: dit >= len(DIT_LONG))
        if hold_ar is not None:
            hold_ar.rearm()
        start(AR_LONG)
        if hold_ar is not None:
            hold_ar.wait(alive=self.server.alive)
            wait_until(lambda ar, dit: ar >= len(AR_LONG))
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

    def answered(self) -> list[int | str]:
        """The statuses of the requests sent so far, once each is answered (then forgets them)."""
        for thread in self.threads:
            thread.join(300)
        responses, self.responses, self.threads = self.responses, [], []
        return responses

    def ar_replica(self) -> dict[str, Any]:
        health = http_client.get(self.server.base_url + "/health", timeout=30).json()
        return health["stages"]["0"]["replicas"][0]

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


def top_level(names: list[str]) -> list[str]:
    """The entries of a temp directory listing (``left_in_temp``) at its top level."""
    return sorted(n for n in names if "/" not in n)


def present(segments: list[str]) -> list[str]:
    return [n for n in segments if os.path.exists(os.path.join(SHM_DIR, n))]


def deploy_for(deployment: str, directory: Path) -> Path:
    if deployment == "shared_memory":
        return DEPLOY
    path = directory / f"tiny_glm_image_{deployment}.yaml"
    path.write_text(NETWORK_DEPLOY.format(connectors=network_connectors()))
    return path


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_every_stop_leaves_nothing_and_spares_the_server_beside(
    deployment: str, tiny_glm_image: Path, tmp_path: Path
) -> None:
    """Servers of one deployment in one temp directory, each stopped another way: B by a SIGKILL of its
    main process alone (over shared memory: the network deployment's processes do the same), C by a SIGKILL
    of its whole group (a container runtime's hard stop), then E starts and sweeps what B and C left but
    not D's, which still serves beside; over the network connectors A's AR engine is SIGKILLed under load
    and restarted (no request lost), then A gets SIGTERM at its main process (as ``kill`` or systemd
    send it: drained, not dropped); D gets a Ctrl-C (SIGINT to the group), and E SIGTERM to the group
    then SIGKILL to the group once its main process is gone (as container runtimes stop a container:
    nothing may rely on a process outliving the main one). The shared-memory deployment's A is
    ``test_api_server.py``'s server (the deploy file as it is): its AR engine killed under load, then
    SIGTERM at its main process with a request in each stage, leaving nothing."""
    deploy = deploy_for(deployment, tmp_path)
    env = user_like_env()
    started: list[Served] = []

    def start(*names: str) -> list[Served]:
        servers = [Served(tiny_glm_image, deploy, tmp_path / name, env) for name in names]
        started.extend(servers)
        return [server.ready() for server in servers]  # started side by side, then waited for

    try:
        main_alone = deployment == "shared_memory"
        c, d, other = start("c", "d", "b" if main_alone else "a")
        a, b = (None, other) if main_alone else (other, None)
        swept: list[str] = []
        if b is not None:
            b_runtime = b.runtime_dir()
            assert any(n.startswith(f"{b_runtime}/ar0-0/") for n in b.temp_left()), "the engine's endpoints"
            os.kill(b.pid, signal.SIGKILL)
            assert b.wait_main() == -signal.SIGKILL
            processes, b_segments = b.left()
            assert processes == {}  # the stage processes noticed their parent's death and exited
            # what the main process itself owned stays for the next start's sweep: its pool, its runtime dir
            assert all(name.startswith(f"vllm_omni_{b.pid}_") for name in b_segments), b_segments
            swept += b_segments
            assert b_runtime in top_level(d.temp_left())

        c_runtime = c.runtime_dir()
        c_semaphores = semaphores_of([c.pid, *descendants(c.pid)])
        assert c_semaphores, "expected the multiprocessing semaphores of the group"
        os.killpg(c.pid, signal.SIGKILL)
        assert c.wait_main() == -signal.SIGKILL
        processes, c_segments = c.left()
        assert processes == {}
        # nobody lived to unlink the group's segments (its pools, vLLM's message queues) or its runtime
        # directory, which lists the segments its engine mapped: the next start's sweeps remove them
        assert c_segments and all(name.startswith(("vllm_omni_", "psm_")) for name in c_segments), c_segments
        assert c_runtime in top_level(d.temp_left())

        (e,) = start("e")
        assert present(swept + c_segments + c_semaphores) == []  # semaphores too: nobody maps them
        alive = [server for server in (a, d, e) if server is not None]
        assert top_level(d.temp_left()) == sorted(server.runtime_dir() for server in alive)

        if a is not None:
            before = a.ar_replica()
            ar_hold = a.server.hold("ar.step")
            ar_hold.release()  # armed by send_in_flight, after the DiT-long requests have passed the AR stage
            hold = a.send_in_flight(hold_ar=ar_hold)
            os.kill(before["pid"], signal.SIGKILL)  # the AR engine core, holding the AR-long requests
            ar_hold.release()  # its restarted replica holds nothing
            hold.release()
            assert a.answered() == [200] * len(IN_FLIGHT)  # retried on the restarted engine
            after = a.ar_replica()
            assert (after["restarts"], after["state"]) == (before["restarts"] + 1, "ready"), after

            a_runtime = a.runtime_dir()
            hold = a.send_in_flight()
            os.kill(a.pid, signal.SIGTERM)
            hold.release()  # the DiT-long requests finish while the server drains
            assert a.wait_main() == 0, a.server.log_text()[-3000:]
            assert a.answered() == [200] * len(IN_FLIGHT)  # drained, not dropped
            assert a.left() == ({}, [])
            assert a_runtime not in top_level(d.temp_left())

        hold = d.send_in_flight()
        os.killpg(d.pid, signal.SIGINT)
        hold.release()
        assert d.wait_main() == 0, d.server.log_text()[-3000:]
        assert d.left() == ({}, [])

        hold = e.send_in_flight()
        os.killpg(e.pid, signal.SIGTERM)
        hold.release()
        assert e.wait_main() == 0, e.server.log_text()[-3000:]
        os.killpg(e.pid, signal.SIGKILL)  # the group, at once: resource tracker and stragglers included
        assert e.left() == ({}, [])

        assert left_in_temp(env) == []
    finally:
        for server in started:
            server.finish()
        shutil.rmtree(env["TMPDIR"], ignore_errors=True)
