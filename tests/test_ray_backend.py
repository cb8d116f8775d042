"""Backend ray: the tiny GLM-Image served by ``vllm serve --omni`` on a Ray cluster of three nodes on
this machine (``ray.cluster_utils.Cluster``: a head with ``ar_host``, two nodes with ``dit_host``), every
stage replica a Ray actor; real HTTP, real NIXL from the AR node to the DiT nodes and Mooncake's
transfer engine (TCP) from the DiT nodes back to the API server.

One cluster and one deployment for the module (the AR stage on the head node, two DiT replicas, one per
``dit_host`` node); the tests run in order and the last ones change the cluster (a killed actor, lost
and added nodes). The local-backend image is the run's one local ``vllm serve --omni`` of the tiny
GLM-Image (``glm_image_served``), made before the cluster starts.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from PIL import Image

from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.forks import run_to_end
from vllm_omni_testkit.harness.served_reference import GENERATION
from vllm_omni_testkit.harness.server import (
    ServerProcess,
    bin_script,
    cpu_test_env,
    free_port,
    wait_for_metric,
)

ray = pytest.importorskip("ray", reason="backend ray needs the `ray` extra")
pytest.importorskip("mooncake.engine", reason="the DiT -> router edge needs the `mooncake-cpu` extra")

pytestmark = pytest.mark.server

NAMESPACE = "vllm_omni_test"
NODE = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}
"""Each Ray node: one CPU (an actor each), the smallest object store Ray accepts plus a little."""
DEPLOY = f"""
base_config: tiny_glm_image_cpu.yaml
backend: ray
ray: {{namespace: {NAMESPACE}, placement_timeout_s: 600}}
connectors:
  nixl: {{name: NixlConnector, extra: {{transfer_timeout_s: 30}}}}
  mooncake: {{name: MooncakeTransferEngineConnector, extra: {{protocol: tcp, transfer_timeout_s: 30}}}}
  shm: {{name: SharedMemoryConnector}}
edges:
  - {{from: 0, to: 1, same_node_connector: shm}}
  - {{from: 1, to: router, same_node_connector: shm}}
stages:
  - stage_id: 0
    num_cpus: 1
    resources: {{ar_host: 1}}
    output_connectors: {{to_stage_1: nixl}}
  - stage_id: 1
    num_replicas: 2
    num_cpus: 1
    resources: {{dit_host: 1}}
    output_connectors: {{to_stage_router: mooncake}}
"""
UNPLACEABLE = """
base_config: glm_image_tiny_ray.yaml
ray: {placement_timeout_s: 5}
stages:
  - stage_id: 0
    resources: {tpu_v9: 1}
"""
HELD_AR_LOAD = """
base_config: tiny_glm_image_cpu.yaml
backend: ray
ray: {{namespace: {namespace}, placement_timeout_s: 600}}
stages:
  - stage_id: 0
    num_cpus: 0
    env: {{VLLM_OMNI_HOLD_DIR: {hold_dir}, VLLM_OMNI_TEST_HOOKS: vllm_omni_testkit.holds}}
  - stage_id: 1
    num_cpus: 0
"""
"""A second deployment beside the served one (no CPU of the cluster is free): its AR engine core holds
at ``ar.load`` in its start-up (the hold directory and the test hooks reach the actor through the stage's env)."""
CFG_PARALLEL = """
pipeline: diffusion
backend: ray
ray: {{namespace: {namespace}, placement_timeout_s: 600}}
connectors:
  mooncake: {{name: MooncakeTransferEngineConnector, extra: {{protocol: tcp, transfer_timeout_s: 30}}}}
  shm: {{name: SharedMemoryConnector}}
edges:
  - {{from: 0, to: router, same_node_connector: shm}}
stages:
  - {{stage_id: 0, num_cpus: 0, cfg_parallel_size: 2, output_connectors: {{to_stage_router: mooncake}}}}
"""
"""A CFG-parallel diffusion stage beside the served deployment: its actor starts the replica's peer. Ray
places it on any node (no CPU is free), so its images reach the API server as the DiT replicas' do."""
REQUEST = GENERATION
SLOW_REQUEST = {**REQUEST, "seed": 12, "num_inference_steps": 400}
"""Long enough in the DiT for its actor to be killed while it works on it."""
STEPS = "omni_diffusion_denoise_steps_total"


def pixels(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def serve_argv(model: Path, deploy: Path, port: int, *extra: str) -> list[str]:
    return [bin_script("vllm"), "serve", str(model), "--omni", "--deploy-config", str(deploy),
            "--port", str(port), "--host", "127.0.0.1", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def deploy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ray_backend")
    (folder / "unplaceable.yaml").write_text(UNPLACEABLE)
    path = folder / "glm_image_tiny_ray.yaml"
    path.write_text(DEPLOY)
    return path


@pytest.fixture(scope="module")
def local_image(glm_image_served: dict[str, np.ndarray]) -> np.ndarray:
    """What ``vllm serve --omni`` makes of ``REQUEST`` with every stage a process of this host (the
    run's one local server of the tiny GLM-Image: the image depends on neither backend nor connector)."""
    return glm_image_served["generation"]


@dataclass
class RayCluster:
    cluster: Any
    head: Any
    dit_nodes: list[Any]


@pytest.fixture(scope="module")
def cluster(local_image: np.ndarray) -> Iterator[RayCluster]:
    """Three Ray nodes on this machine; this test process is a driver of it (the state API's client)."""
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="ray_omni_", dir="/tmp")  # Ray's socket paths must stay short
    saved = {key: os.environ.get(key) for key in ("RAY_TMPDIR", "TMPDIR", "RAY_worker_niceness")}
    os.environ["RAY_TMPDIR"] = temp_dir  # Cluster notes "the" local cluster's address in RAY_TMPDIR/ray
    os.environ["TMPDIR"] = temp_dir  # what Ray's processes leave in a temporary directory goes with it
    # Ray starts its workers at nice 15: beside any other busy process (a loaded CI machine) the stage
    # actors then get a few percent of a core, and the AR engine takes a quarter of an hour to load.
    os.environ["RAY_worker_niceness"] = "0"
    os.makedirs(os.path.join(temp_dir, "ray"))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE, "resources": {"ar_host": 1}, "temp_dir": os.path.join(temp_dir, "ray"),
                        "include_dashboard": True, "dashboard_port": 0},
    )  # fmt: skip
    try:
        dit_nodes = [cluster.add_node(**NODE, resources={"dit_host": 1}) for _ in range(2)]
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        yield RayCluster(cluster, cluster.head_node, dit_nodes)
    finally:
        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(temp_dir, ignore_errors=True)


@dataclass
class Served:
    server: ServerProcess
    cluster: RayCluster

    def url(self, path: str) -> str:
        return self.server.base_url + path

    def health(self) -> tuple[int, dict]:
        response = http_client.get(self.url("/health"), timeout=10)
        return response.status_code, response.json()

    def dit_replicas(self) -> list[dict]:
        return self.health()[1]["stages"]["1"]["replicas"]

    def wait_health(self, check: Any, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            _, body = self.health()
            if check(body):
                return body
            assert time.monotonic() < deadline, body
            time.sleep(0.25)

    def generate(self, request: dict) -> httpx.Response:
        return http_client.post(self.url("/v1/images/generations"), json=request, timeout=300)


@pytest.fixture(scope="module")
def served(
    cluster: RayCluster, tiny_glm_image: Path, deploy: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    port = free_port()
    env = cpu_test_env({"RAY_ADDRESS": cluster.cluster.address})
    server = ServerProcess(
        serve_argv(tiny_glm_image, deploy, port), port=port, env=env,
        log_path=tmp_path_factory.mktemp("ray_server") / "server.log",
    )  # fmt: skip
    with server:
        server.wait_ready(timeout=900)
        yield Served(server, cluster)


def stage_actors() -> dict[str, Any]:
    """Our stage actors that Ray's state API lists as alive, by name."""
    from ray.util.state import list_actors

    alive = [("state", "=", "ALIVE"), ("class_name", "=", "StageReplicaActor")]
    actors = list_actors(filters=alive, limit=100, detail=True)
    return {a.name: a for a in actors}


def actor_stats(name: str) -> dict[str, Any]:
    """What a stage actor itself says (requests served, its connectors), asked through Ray."""
    return msgspec.msgpack.decode(
        ray.get(ray.get_actor(name, namespace=NAMESPACE).stats.remote(), timeout=30)
    )


def actor_steps(name: str) -> int:
    """The denoising steps a stage actor itself counted (this incarnation's)."""
    reported = ray.get(ray.get_actor(name, namespace=NAMESPACE).diffusion_counters.remote(), timeout=30)
    return msgspec.msgpack.decode(reported, type=DiffusionCounters).denoise_steps


def test_each_stage_runs_on_the_nodes_its_resources_name(served: Served) -> None:
    actors = stage_actors()
    ar = [a for name, a in actors.items() if "-stage0-" in name]
    dit = [a for name, a in actors.items() if "-stage1-" in name]
    assert len(ar) == 1 and len(dit) == 2, sorted(actors)
    assert ar[0].node_id == served.cluster.head.node_id
    assert {a.node_id for a in dit} == {n.node_id for n in served.cluster.dit_nodes}

    # /health names the same actors and nodes; each DiT replica, on another node than the API server,
    # takes its input over NIXL and hands its image over through Mooncake.
    for replica in served.dit_replicas():
        assert replica["state"] == "ready" and replica["waiting"] is None
        assert actors[replica["actor"]].node_id == replica["node"]
        assert actors[replica["actor"]].pid == replica["pid"]
        stats = actor_stats(replica["actor"])
        assert (stats["input_connector"], stats["output_connector"]) == ("nixl", "mooncake")


def test_same_image_as_the_local_backend(served: Served, local_image: np.ndarray) -> None:
    np.testing.assert_array_equal(pixels(served.generate(REQUEST)), local_image)


def test_least_loaded_routing_spreads_16_concurrent_requests_over_both_dit_replicas(served: Served) -> None:
    names = [r["actor"] for r in served.dit_replicas()]
    before = {name: actor_stats(name)["served"] for name in names}
    # nothing restarted yet: the head's count is what the actors counted, once it has asked them
    steps = sum(actor_steps(name) for name in names)
    wait_for_metric(served.server.metric, STEPS, steps)
    responses: list[httpx.Response] = []
    requests = [{**REQUEST, "seed": 100 + i, "prompt": f"fox {i}"} for i in range(16)]
    threads = [threading.Thread(target=lambda r=r: responses.append(served.generate(r))) for r in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.status_code for r in responses] == [200] * 16, [
        r.text for r in responses if r.status_code != 200
    ]
    served_now = {name: actor_stats(name)["served"] - before[name] for name in names}
    assert sum(served_now.values()) == 16
    assert all(count > 0 for count in served_now.values()), served_now
    # the head's /metrics counts the steps the actors ran
    wait_for_metric(served.server.metric, STEPS, steps + 16 * REQUEST["num_inference_steps"])


def test_killed_dit_actor_is_restarted_by_ray_and_serves_again(
    served: Served, local_image: np.ndarray
) -> None:
    outcome: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: outcome.append(served.generate(SLOW_REQUEST)))
    worker.start()

    def dit_busy(body: dict) -> bool:
        assert not outcome, f"the request ended before the DiT took it: {outcome[0].text}"
        return any(r["inflight"] for r in body["stages"]["1"]["replicas"])

    busy = served.wait_health(dit_busy, timeout=120)
    victim = next(r for r in busy["stages"]["1"]["replicas"] if r["inflight"])
    counted = served.server.metric(STEPS)
    os.kill(victim["pid"], signal.SIGKILL)
    worker.join(300)

    # As on the local backend: the request whose replica died gets 503 (or is retried and succeeds).
    response = outcome[0]
    assert response.status_code in (200, 503), response.text
    if response.status_code == 503:
        assert "stage 1" in response.json()["error"]["message"]

    def restarted(body: dict) -> bool:
        replica = body["stages"]["1"]["replicas"][victim["replica_id"]]
        return replica["state"] == "ready" and replica["restarts"] == 1

    body = served.wait_health(restarted)
    replica = body["stages"]["1"]["replicas"][victim["replica_id"]]
    assert replica["pid"] != victim["pid"] and replica["node"] == victim["node"]
    state = stage_actors()[victim["actor"]]
    assert state.num_restarts >= 1 and state.pid == replica["pid"]
    np.testing.assert_array_equal(pixels(served.generate(REQUEST)), local_image)
    # the restarted actor counts from 0; the head's count goes on from the dead one's
    wait_for_metric(served.server.metric, STEPS, counted + REQUEST["num_inference_steps"], at_least=True)


def test_lost_dit_nodes_make_the_stage_wait_and_a_new_node_brings_it_back(
    served: Served, local_image: np.ndarray
) -> None:
    cluster = served.cluster
    for node in cluster.dit_nodes:
        cluster.cluster.remove_node(node)
    cluster.dit_nodes = []

    def waiting(body: dict) -> bool:
        return all(r["waiting"] and r["state"] == "restarting" for r in body["stages"]["1"]["replicas"])

    body = served.wait_health(waiting, timeout=120)
    status, body = served.health()
    assert status == 200 and body["status"] == "waiting_for_workers", body
    assert not body["stages"]["1"]["healthy"] and body["stages"]["0"]["healthy"]
    for replica in body["stages"]["1"]["replicas"]:
        assert "no alive node of the Ray cluster has {CPU: 1, dit_host: 1}" in replica["waiting"], replica

    node = cluster.cluster.add_node(**{**NODE, "num_cpus": 2}, resources={"dit_host": 2})
    cluster.dit_nodes = [node]
    body = served.wait_health(lambda b: all(r["state"] == "ready" for r in b["stages"]["1"]["replicas"]))
    assert body["status"] == "ok"
    assert all(r["node"] == node.node_id for r in body["stages"]["1"]["replicas"])
    assert {a.node_id for name, a in stage_actors().items() if "-stage1-" in name} == {node.node_id}
    np.testing.assert_array_equal(pixels(served.generate(REQUEST)), local_image)


def test_a_stage_asking_for_a_resource_no_node_has_fails_start_up_with_one_line(
    cluster: RayCluster, tiny_glm_image: Path, deploy: Path
) -> None:
    argv = serve_argv(tiny_glm_image, deploy.parent / "unplaceable.yaml", free_port())
    env = cpu_test_env({"RAY_ADDRESS": cluster.cluster.address})
    before = set(stage_actors())
    result = run_to_end(argv, env, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr[-3000:]
    wants = "{CPU: 1, ar_host: 1, tpu_v9: 1}"
    assert errors[0].startswith(
        f"error: stage 0 (ar) replica 0 cannot be placed: it asks for {wants} and no alive node of the Ray "
        f"cluster has {wants}"
    ), errors[0]
    assert errors[0].endswith("after 5 s (ray.placement_timeout_s)"), errors[0]
    assert "Traceback" not in result.stderr
    assert set(stage_actors()) == before  # none of its actors stayed behind


def test_a_server_interrupted_while_its_ar_engine_loads_leaves_no_actor_process_or_shared_memory(
    served: Served, tiny_glm_image: Path, tmp_path: Path
) -> None:
    """Ctrl-C while a Ray actor's vLLM engine starts: the actor ends the engine's processes (and what
    they mapped in /dev/shm) before it goes, where a bare kill of the actor left them behind."""
    from vllm_omni_plugin.processes import ProcessId, descendants, mapped_segments

    port = free_port()
    deploy = tmp_path / "held.yaml"
    server = ServerProcess(
        serve_argv(tiny_glm_image, deploy, port), port=port, log_path=tmp_path / "server.log",
        env=cpu_test_env({"RAY_ADDRESS": served.cluster.cluster.address}),
    )  # fmt: skip
    deploy.write_text(HELD_AR_LOAD.format(namespace=NAMESPACE, hold_dir=server.holds.directory))
    before = set(stage_actors())
    with server:
        hold = server.hold("ar.load")
        engine_core = int(hold.wait(timeout=600, alive=server.alive).split()[1])
        pids = [engine_core, *descendants(engine_core)]
        engine = [p for p in map(ProcessId.of, pids) if p is not None]
        segments = set().union(*(mapped_segments(pid) for pid in pids))
        assert any(name.startswith("psm_") for name in segments), segments  # vLLM's queues to its workers
        assert set(stage_actors()) - before, "the new deployment's actors are not up"
        assert server.proc is not None
        os.killpg(server.proc.pid, signal.SIGINT)  # the hold stays: the engine is stopped inside its start
        server.proc.wait(120)
        log = server.log_text()
    assert "Traceback" not in log, log[-4000:]
    deadline = time.monotonic() + 60  # a killed actor's children are reaped by init
    while (left := [p.pid for p in engine if p.alive()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], f"engine processes {left} outlived the stop"
    assert sorted(n for n in segments if os.path.exists(f"/dev/shm/{n}")) == [], "shared memory left"
    assert set(stage_actors()) == before  # its actors are gone, the served deployment's stay
    assert served.health()[0] == 200


def test_a_cfg_parallel_stage_on_ray_gives_the_diffusers_images_and_its_peer_ends_with_it(
    served: Served, tiny_sd3: Path, tmp_path: Path
) -> None:
    """A diffusion stage with ``cfg_parallel_size: 2`` as a Ray actor: the actor's replica starts its
    peer process, the images equal a stock diffusers call's, and stopping the server ends the peer."""
    from ray.util.state import list_actors

    from vllm_omni_plugin.processes import ProcessId, cmdline, descendants
    from vllm_omni_testkit.reference.diffusers import reference_image

    deploy = tmp_path / "cfg.yaml"
    deploy.write_text(CFG_PARALLEL.format(namespace=NAMESPACE))
    port = free_port()
    before = set(stage_actors())
    server = ServerProcess(
        serve_argv(tiny_sd3, deploy, port), port=port, log_path=tmp_path / "server.log",
        env=cpu_test_env({"RAY_ADDRESS": served.cluster.cluster.address}),
    )  # fmt: skip
    with server:
        server.wait_ready(timeout=600)
        new = set(stage_actors()) - before
        assert len(new) == 1, new
        actor = list_actors(filters=[("name", "=", new.pop())], detail=True)[0]
        peers = [
            p
            for p in map(ProcessId.of, descendants(actor.pid))
            if p is not None and "-m vllm_omni_plugin.diffusion.peer" in cmdline(p.pid)
        ]
        assert len(peers) == 1, peers
        body = {"prompt": "a red fox", "size": "64x64", "n": 2, "num_inference_steps": 4,
                "guidance_scale": 3.0, "seed": 21}  # fmt: skip
        answer = http_client.post(f"{server.base_url}/v1/images/generations", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        for i, item in enumerate(answer.json()["data"]):
            image = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))
            expected = reference_image(
                tiny_sd3, prompt="a red fox", seed=21 + i, height=64, width=64, steps=4, guidance=3.0
            )
            diff = np.abs(image.astype(np.int16) - expected.astype(np.int16))
            assert diff.max() <= 1 and (diff > 0).mean() < 0.01
        log = server.log_text()
    assert "Traceback" not in log, log[-4000:]
    deadline = time.monotonic() + 60
    while any(p.alive() for p in peers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(p.alive() for p in peers), "the peer outlived its stage"
    assert set(stage_actors()) == before
    assert served.health()[0] == 200


def test_sigterm_stops_the_ray_deployment_with_exit_0_and_ends_its_actors(served: Served) -> None:
    """Last in this module: the served deployment stopped as systemd or Kubernetes stop it."""
    assert served.server.stop(how=signal.SIGTERM) == 0, served.server.log_text()[-3000:]
    assert "Traceback" not in served.server.log_text()
    deadline = time.monotonic() + 60  # Ray ends killed actors asynchronously
    while stage_actors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert stage_actors() == {}
