"""GLM-Image on two "hosts": the head (API server + AR stage) in one network namespace, a headless DiT
worker in another, joined by a veth pair; the AR -> DiT hop over NIXL (UCX over TCP on the veth) and the
DiT -> router hop over Mooncake's transfer engine (TCP, ``host: auto`` finding the veth's address), so that
each connector's owner and reader sit on different hosts (NIXL on both hops where Mooncake is not
installed). Real ``vllm serve --omni`` processes, a tiny random-weight GLM-Image, real HTTP."""

from __future__ import annotations

import base64
import functools
import io
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from vllm_omni_plugin.processes import SHM_DIR, unlink_segment, unmapped
from vllm_omni_testkit.harness.leaks import LeakWatch
from vllm_omni_testkit.harness.netns import NamespaceHTTP, NamespacePair
from vllm_omni_testkit.harness.network_deploy import network_connectors
from vllm_omni_testkit.harness.served_reference import GENERATION
from vllm_omni_testkit.harness.server import (
    ServerProcess,
    bin_script,
    cpu_test_env,
    metric_value,
    wait_denoising,
    wait_for_metric,
)

pytestmark = pytest.mark.server

HEAD_PORT = 29611
HTTP_PORT = 8000
DEPLOY = """
base_config: tiny_glm_image_cpu.yaml
{connectors}head:
  port: {HEAD_PORT}
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 3
stages:
  - stage_id: 0
    output_connectors: {{to_stage_1: ar_to_dit}}
  - stage_id: 1
    headless: true
    input_connectors: {{from_stage_0: ar_to_dit}}
    output_connectors: {{to_stage_router: dit_to_router}}
"""
REQUEST = GENERATION


@pytest.fixture(scope="module")
def namespaces() -> Iterator[NamespacePair]:
    try:
        pair = NamespacePair.create()
    except OSError as exc:
        pytest.skip(f"network namespaces cannot be created on this machine: {exc}")
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture(scope="module")
def deploy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two-host deployment: NIXL to the DiT, Mooncake back (NIXL where Mooncake is missing)."""
    path = tmp_path_factory.mktemp("headless") / "glm_image_two_hosts.yaml"
    path.write_text(DEPLOY.format(connectors=network_connectors(), HEAD_PORT=HEAD_PORT))
    return path


def serve_argv(model: Path, deploy: Path, *extra: str) -> list[str]:
    return [bin_script("vllm"), "serve", str(model), "--omni", "--deploy-config", str(deploy), *extra]


def pixels(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.fixture(scope="module")
def single_host_image(glm_image_served: dict[str, np.ndarray]) -> np.ndarray:
    """What the run's one local ``vllm serve --omni`` of the tiny GLM-Image makes of ``REQUEST``, every
    stage on one host (the image depends on no connector). How such a server stops on SIGTERM over NIXL
    (exit status 0, nothing left in its temp directory) is tests/test_stops.py's."""
    return glm_image_served["generation"]


@dataclass
class TwoHosts:
    head: ServerProcess
    worker: ServerProcess
    http: NamespaceHTTP
    namespaces: NamespacePair
    argv_worker: list[str]
    env_worker: dict[str, str]
    log_dir: Path

    def url(self, path: str) -> str:
        return self.head.base_url + path

    def health(self) -> dict:
        response = self.http.get(self.url("/health"), timeout=10)
        assert response.status_code == 200, response.text  # the head stays healthy throughout
        return response.json()

    def wait_health(self, status: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while (body := self.health())["status"] != status:
            assert time.monotonic() < deadline, body
            time.sleep(0.2)
        return body

    def start_worker(self, name: str) -> ServerProcess:
        self.worker = ServerProcess(
            self.argv_worker, port=0, env=self.env_worker, log_path=self.log_dir / name
        )
        self.worker.start()
        return self.worker

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.http.get(self.url("/metrics"), timeout=10).text, name, **labels)


@pytest.fixture(scope="module")
def hosts(
    namespaces: NamespacePair,
    deploy: Path,
    tiny_glm_image: Path,
    single_host_image: np.ndarray,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TwoHosts]:
    log_dir = tmp_path_factory.mktemp("two_hosts")
    # UCX over TCP on the veth only: the bytes cannot take a shared-memory shortcut between the "hosts".
    head_env = cpu_test_env({"UCX_TLS": "tcp", "UCX_NET_DEVICES": namespaces.a_dev})
    worker_env = cpu_test_env({"UCX_TLS": "tcp", "UCX_NET_DEVICES": namespaces.b_dev})
    head = ServerProcess(
        namespaces.exec_prefix(namespaces.a)
        + serve_argv(tiny_glm_image, deploy, "--port", str(HTTP_PORT), "--host", "0.0.0.0"),
        port=HTTP_PORT,
        host=namespaces.a_addr,
        env=head_env,
        log_path=log_dir / "head.log",
    )
    worker_argv = namespaces.exec_prefix(namespaces.b) + serve_argv(
        tiny_glm_image, deploy, "--stage-id", "1", "--headless", "--head", f"{namespaces.a_addr}:{HEAD_PORT}"
    )
    http = NamespaceHTTP(namespaces.a)
    hosts = TwoHosts(head, None, http, namespaces, worker_argv, worker_env, log_dir)
    # The tests kill a "host" as a whole (its process group, resource tracker included), and a real
    # host's /dev/shm goes with it: what these hosts leave there is removed at the end, not reported.
    # Their semaphores count by time (sem_open maps one under a temporary name, no mapping names it),
    # and only those no live process maps go: another test run's engine may be starting with its own.
    shm_watch = LeakWatch().start()
    semaphores_before = {n for n in os.listdir(SHM_DIR) if n.startswith("sem.")}
    head.start()
    hosts.start_worker("worker.log")
    try:
        head.wait_ready(timeout=300, http=http)
        hosts.worker.wait_for_log("registered with the head", timeout=300)
        hosts.wait_health("ok")
        yield hosts
    finally:
        hosts.worker.stop()
        head.stop()
        http.close()
        shm_watch.stop()
        left = shm_watch.leftovers(grace=10, processes_only=True).segments
        new_semaphores = [
            n for n in os.listdir(SHM_DIR) if n.startswith("sem.") and n not in semaphores_before
        ]
        left += unmapped(new_semaphores)
        for name in left:
            unlink_segment(name)


def test_image_over_the_veth_matches_the_single_host_run(
    hosts: TwoHosts, single_host_image: np.ndarray
) -> None:
    image = pixels(hosts.http.post(hosts.url("/v1/images/generations"), json=REQUEST, timeout=300))
    np.testing.assert_array_equal(image, single_host_image)

    # AR -> DiT: the head put the prior tokens into its connector and the worker read them (the READ's
    # acknowledgement released them); DiT -> router: the head read the image from the worker.
    put = hosts.metric("omni_connector_bytes_total", connector="ar_to_dit", direction="put")
    assert put > 0
    deadline = time.monotonic() + 10
    while hosts.metric("omni_connector_bytes_total", connector="ar_to_dit", direction="acked") < put:
        assert time.monotonic() < deadline, "the worker never acknowledged reading the AR output"
        time.sleep(0.1)
    assert hosts.metric("omni_connector_outstanding", connector="ar_to_dit") == 0
    got = hosts.metric("omni_connector_bytes_total", connector="dit_to_router", direction="get")
    assert got >= 64 * 64 * 3
    assert hosts.metric("omni_connector_errors_total", connector="dit_to_router") == 0

    stage = hosts.health()["stages"]["1"]
    assert stage["healthy"] and stage["replicas"][0]["worker"]
    assert stage["replicas"][0]["pid"] == hosts.worker.proc.pid  # `ip netns exec` runs vllm in place


def test_killed_worker_fails_its_request_with_503_and_a_restarted_worker_rejoins(
    hosts: TwoHosts, single_host_image: np.ndarray
) -> None:
    outcome: dict[str, httpx.Response] = {}
    slow = {**REQUEST, "prompt": "a very slow painting", "num_inference_steps": 1000}

    def slow_request() -> None:
        outcome["response"] = hosts.http.post(hosts.url("/v1/images/generations"), json=slow, timeout=300)

    steps = hosts.metric("omni_diffusion_denoise_steps_total")
    thread = threading.Thread(target=slow_request)
    thread.start()
    wait_denoising(hosts.metric, steps, slow["num_inference_steps"])
    os.killpg(hosts.worker.proc.pid, signal.SIGKILL)  # the worker and its DiT process, like a lost host
    thread.join(120)
    assert "response" in outcome, (
        "no answer 120 s after the worker died; the head's log:\n" + (hosts.head.log_text()[-6000:])
    )
    response = outcome["response"]
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert "stage 1" in message and "rejoin" in message and "Traceback" not in message
    # the lost host leaves nothing registered or leased on the head
    head_connector = functools.partial(hosts.metric, connector="ar_to_dit")
    wait_for_metric(head_connector, "omni_connector_outstanding", 0)

    body = hosts.wait_health("waiting_for_workers")
    assert body["stages"]["0"]["healthy"] is True
    assert body["stages"]["1"]["replicas"][0]["state"] == "restarting"

    hosts.worker.stop()
    hosts.start_worker("worker2.log").wait_for_log("registered with the head", timeout=300)
    body = hosts.wait_health("ok")
    assert body["stages"]["1"]["replicas"][0]["restarts"] == 1
    steps = hosts.metric("omni_diffusion_denoise_steps_total")
    image = pixels(hosts.http.post(hosts.url("/v1/images/generations"), json=REQUEST, timeout=300))
    np.testing.assert_array_equal(image, single_host_image)
    # the new worker counts from 0; the head's count goes on from the lost one's
    wait_for_metric(
        hosts.metric, "omni_diffusion_denoise_steps_total", steps + REQUEST["num_inference_steps"]
    )
    # a headless worker stopped as systemd or Kubernetes stop it exits 0; the next one rejoins
    assert hosts.worker.stop(how=signal.SIGTERM) == 0, hosts.worker.log_text()[-3000:]
    hosts.start_worker("worker3.log").wait_for_log("registered with the head", timeout=300)
    hosts.wait_health("ok")


def test_worker_exits_when_the_head_disappears(hosts: TwoHosts) -> None:
    os.killpg(hosts.head.proc.pid, signal.SIGKILL)  # the head's whole host is gone
    code = hosts.worker.proc.wait(60)
    assert code == 1
    log = hosts.worker.log_text()
    assert "headless worker for stage 1 exiting: the head at" in log and "sent nothing for" in log
    assert "Traceback" not in log
