"""The stage roles under Dynamo (seed 000's shape): Dynamo's real frontend, a router
(``--omni-router``: the orchestrator, the model registered) and stage workers (``--stage-id N``) as
separate processes that find each other through Dynamo's discovery (a folder, loopback only). The tiny
GLM-Image makes the image ``vllm serve --omni`` makes; a DiT worker SIGKILLed under a request leaves the
request to another DiT worker (200), and one started later is used; a client that goes away has its
request aborted in the stage holding it; seed 000's legacy document (NIXL on both hand-overs,
``to_stage_router``) runs as router and stage workers."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from vllm_omni_plugin.processes import SHM_DIR, descendants
from vllm_omni_testkit.harness.dynamo import DynamoSite, dynamo_missing
from vllm_omni_testkit.harness.server import (
    ServerProcess,
    bin_script,
    cpu_test_env,
    free_port,
    wait_for_metric,
)
from vllm_omni_testkit.holds import Hold

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(dynamo_missing() is not None, reason=str(dynamo_missing())),
]

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy" / "tiny_glm_image_cpu.yaml"
GLM = "tiny-glm-image"
PROMPT = "a red fox in the snow"
IMAGE = {"seed": 11, "num_inference_steps": 4}
ENDLESS = 100_000

SEED_000 = """\
# Seed 000's document: GLM-Image AR -> DiT over NIXL in vllm-omni's legacy stage_args schema, the
# synchronous scheduler pinned, runtime.connectors / runtime.edges, the DiT's to_stage_router; sized for
# the tiny model on CPU.
async_chunk: false
runtime:
  enabled: true
  defaults: {window_size: -1, max_inflight: 1}
  connectors:
    nixl_ar2dit: {name: NixlConnector, extra: {backends: [UCX]}}
    dit_to_router: {name: NixlConnector, extra: {backends: [UCX]}}
  edges:
    - {from: 0, to: 1}
stage_args:
  - stage_id: 0
    stage_type: llm
    runtime: {process: true}
    engine_args:
      model_stage: ar
      model_arch: GlmImageForConditionalGeneration
      worker_cls: vllm_omni.worker.gpu_ar_worker.GPUARWorker
      scheduler_cls: vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler
      engine_output_type: token_ids
      model_subdir: vision_language_encoder
      tokenizer_subdir: processor
      enforce_eager: true
      trust_remote_code: true
      max_num_seqs: 4
      max_model_len: 1024
      enable_prefix_caching: false
      dtype: float32
      kv_cache_memory_bytes: 67108864
    engine_input_source: []
    final_output: false
    is_comprehension: false
    default_sampling_params: {temperature: 0.9, top_p: 0.75}
    output_connectors: {to_stage_1: nixl_ar2dit}
  - stage_id: 1
    stage_type: diffusion
    runtime: {process: true, max_batch_size: 2}
    engine_args:
      model_stage: dit
      trust_remote_code: true
      dtype: float32
      num_inference_steps: 4
      guidance_scale: 1.5
      height: 64
      width: 64
    engine_input_source: [0]
    custom_process_input_func: vllm_omni.model_executor.stage_input_processors.glm_image.ar2diffusion
    final_output: true
    final_output_type: image
    default_sampling_params: {seed: 42}
    input_connectors: {from_stage_0: nixl_ar2dit}
    output_connectors: {to_stage_router: dit_to_router}
"""


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def vllm_serve_image(model: Path, log_dir: Path) -> np.ndarray:
    port = free_port()
    argv = [bin_script("vllm"), "serve", str(model), "--omni", "--deploy-config", str(DEPLOY),
            "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
    with ServerProcess(argv, port=port, log_path=log_dir / "vllm_serve.log", env=cpu_test_env()) as server:
        server.wait_ready(timeout=600)
        made = httpx.post(
            server.base_url + "/v1/images/generations",
            json={"prompt": PROMPT, "size": "64x64", **IMAGE},
            timeout=300,
        )
        assert made.status_code == 200, made.text
        return pixels(made.json()["data"][0]["b64_json"])


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoSite]:
    """Dynamo's frontend; at the end, nothing of this module's left (processes, shared memory)."""
    with DynamoSite.running(tmp_path_factory.mktemp("dynamo_stages")) as site:
        yield site


@dataclass
class Stages:
    site: DynamoSite
    router: ServerProcess
    workers: dict[str, ServerProcess]
    argv: list[str]
    client: openai.OpenAI
    reference: np.ndarray | None

    def joined(self, stage: int) -> int:
        """Workers of ``stage`` the router took in so far (its log says each once)."""
        return sum(
            1
            for line in self.router.log_text().splitlines()
            if f"stage {stage} (" in line and " joined (" in line
        )

    def wait_joined(self, stage: int, count: int, timeout: float = 900) -> None:
        def joined() -> bool:
            for name, worker in self.workers.items():
                if not worker.alive() and worker.proc is not None and worker.proc.returncode != -9:
                    raise AssertionError(f"stage worker {name} exited:\n{worker.log_text()[-4000:]}")
            return self.joined(stage) >= count

        self.router.wait_until(joined, timeout)

    def start_worker(self, name: str, stage: int) -> ServerProcess:
        self.workers[name] = self.site.worker(*self.argv, "--stage-id", str(stage), name=name)
        return self.workers[name]

    def image(self, prompt: str = PROMPT, **extra: Any) -> np.ndarray:
        made = self.client.images.generate(
            model=GLM, prompt=prompt, size="64x64", extra_body={**IMAGE, **extra}
        )
        return pixels(made.data[0].b64_json)


def deploy_stages(site: DynamoSite, argv: list[str], dits: int, reference: np.ndarray | None) -> Stages:
    router = site.worker(*argv, "--omni-router", "--served-model-name", GLM,
                         "--image-max-inference-steps", str(ENDLESS), name="router")  # fmt: skip
    client = openai.OpenAI(base_url=site.processes[0].base_url + "/v1", api_key="unused", timeout=300)
    stages = Stages(site, router, {}, argv, client, reference)
    stages.start_worker("ar", 0)
    for i in range(dits):
        stages.start_worker(f"dit{i}", 1)
    stages.wait_joined(0, 1)
    stages.wait_joined(1, dits)
    frontend = site.processes[0]
    try:
        frontend.wait_until(
            lambda: any(
                m["id"] == GLM for m in httpx.get(frontend.base_url + "/v1/models", timeout=5).json()["data"]
            ),
            600,
            stop=False,  # the module's frontend: the other classes' deployments use it
        )
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\nthe router's log tail:\n{router.log_text()[-4000:]}") from None
    return stages


@pytest.fixture(scope="class")
def stages(site: DynamoSite, tiny_glm_image: Path) -> Iterator[Stages]:
    reference: dict[str, np.ndarray] = {}
    baseline = threading.Thread(
        target=lambda: reference.update(image=vllm_serve_image(tiny_glm_image, site.directory))
    )
    baseline.start()
    deployed = deploy_stages(site, [str(tiny_glm_image), "--deploy-config", str(DEPLOY)], 2, None)
    try:
        baseline.join(900)
        deployed.reference = reference["image"]
        yield deployed
    finally:
        deployed.client.close()
        running = [p for p in (deployed.router, *deployed.workers.values()) if p.alive()]  # not the killed
        statuses = site.stop(running, how=signal.SIGTERM)
        assert statuses and set(statuses.values()) == {0}, statuses  # as systemd or Kubernetes stop it


def first_reached(holds: dict[str, Hold], alive: Any, timeout: float = 300) -> str:
    """The name of the worker whose hold point took the request."""
    deadline = time.monotonic() + timeout
    while True:
        reached = [name for name, hold in holds.items() if hold.reached]
        if reached:
            return reached[0]
        assert alive(), "a worker died before the request reached a hold point"
        assert time.monotonic() < deadline, "no DiT worker held the request"
        time.sleep(0.01)


class TestStageRoles:
    def test_router_and_stage_workers_make_the_image_vllm_serve_makes(self, stages: Stages) -> None:
        assert stages.joined(1) == 2  # both DiT workers are the stage's replicas
        np.testing.assert_array_equal(stages.image(), stages.reference)
        dits = [stages.workers["dit0"], stages.workers["dit1"]]
        served = sum(w.metric("omni_stage_worker_requests_total") for w in dits)
        assert served >= 1
        # the router collects the image its DiT worker put into the shared-memory connector
        assert stages.router.metric("omni_connector_bytes_total", direction="get") >= 64 * 64 * 3

    def test_a_dit_worker_killed_under_a_request_leaves_it_to_another_and_a_new_one_is_used(
        self, stages: Stages
    ) -> None:
        router = stages.router
        deaths = router.metric("omni_stage_replica_deaths_total", stage="1")
        retries = router.metric("omni_stage_retries_total", stage="1")
        names = ("dit0", "dit1")
        outcome: dict[str, Any] = {}

        def request() -> None:
            try:
                outcome["image"] = stages.image()
            except Exception as exc:  # the assertion below says what
                outcome["error"] = exc

        holds = {name: stages.workers[name].hold("dit.step") for name in names}
        thread = threading.Thread(target=request)
        thread.start()
        victim = first_reached(holds, lambda: all(stages.workers[n].alive() for n in names))
        for name, hold in holds.items():
            if name != victim:
                hold.release()  # disarmed: the retry runs through on this worker
        killed = stages.workers[victim]
        assert killed.proc is not None
        tree = [killed.proc.pid, *descendants(killed.proc.pid)]
        os.kill(killed.proc.pid, signal.SIGKILL)  # the worker process only: its DiT process follows it
        thread.join(600)
        assert "error" not in outcome, outcome.get("error")
        np.testing.assert_array_equal(outcome["image"], stages.reference)
        assert router.metric("omni_stage_replica_deaths_total", stage="1") == deaths + 1
        assert router.metric("omni_stage_retries_total", stage="1") == retries + 1
        # the lost worker leaves nothing behind: its processes are gone, and their shared memory with them
        killed.proc.wait(60)
        deadline = time.monotonic() + 60
        while [p for p in tree if os.path.exists(f"/proc/{p}")] or [
            n for n in os.listdir(SHM_DIR) if any(n.startswith(f"vllm_omni_{p}_") for p in tree)
        ]:
            assert time.monotonic() < deadline, "the killed worker's processes or segments are still there"
            time.sleep(0.2)
        killed.stop()

        late = stages.start_worker("dit2", 1)
        stages.wait_joined(1, 3)
        assert late.metric("omni_stage_worker_requests_total") == 0
        np.testing.assert_array_equal(stages.image(), stages.reference)  # the newcomer has had the fewest
        assert late.metric("omni_stage_worker_requests_total") == 1

    def test_a_client_that_goes_away_is_aborted_in_the_stage_holding_it(self, stages: Stages) -> None:
        body = {"model": GLM, "prompt": "a painting nobody waits for", "size": "64x64", "seed": 3,
                "num_inference_steps": ENDLESS}  # fmt: skip
        frontend = stages.site.processes[0]
        dits = [w for n, w in stages.workers.items() if n.startswith("dit") and w.alive()]
        for stage, point, where, workers in (("0", "ar.step", "engine", [stages.workers["ar"]]),
                                             ("1", "dit.step", "batch", dits)):  # fmt: skip
            drops = stages.router.metric("omni_stage_aborted_requests_total", stage=stage, where=where)
            gone = stages.router.metric("omni_client_disconnects_total")

            async def main(point: str = point, workers: list[ServerProcess] = workers) -> str:
                holds = {str(i): w.hold(point) for i, w in enumerate(workers)}
                try:
                    async with httpx.AsyncClient(base_url=frontend.base_url, timeout=600) as client:
                        work = asyncio.ensure_future(client.post("/v1/images/generations", json=body))
                        held = await asyncio.to_thread(
                            first_reached, holds, lambda: all(w.alive() for w in workers)
                        )
                        work.cancel()  # the client closes its connection while the stage holds its request
                        with pytest.raises(asyncio.CancelledError):
                            await work
                        return held
                finally:
                    for hold in holds.values():
                        hold.release()

            holder = workers[int(asyncio.run(main()))]
            wait_for_metric(  # the worker holding it dropped it ...
                lambda sample, holder=holder, stage=stage, where=where: holder.metric(
                    sample, stage=stage, where=where
                ),
                "omni_stage_aborted_requests_total",
                1,
                at_least=True,
            )
            wait_for_metric(  # ... and the router counts what its workers dropped
                lambda sample, stage=stage, where=where: stages.router.metric(
                    sample, stage=stage, where=where
                ),
                "omni_stage_aborted_requests_total",
                drops + 1,
            )
            assert stages.router.metric("omni_client_disconnects_total") == gone + 1
        np.testing.assert_array_equal(stages.image(), stages.reference)


@pytest.fixture(scope="class")
def seed_000(site: DynamoSite, tiny_glm_image: Path) -> Iterator[Stages]:
    document = site.directory / "seed_000_stage_args.yaml"
    document.write_text(SEED_000)
    deployed = deploy_stages(site, [str(tiny_glm_image), "--stage-configs-path", str(document)], 1, None)
    try:
        yield deployed
    finally:
        deployed.client.close()
        running = [p for p in (deployed.router, *deployed.workers.values()) if p.alive()]  # not the killed
        statuses = site.stop(running, how=signal.SIGTERM)
        assert statuses and set(statuses.values()) == {0}, statuses  # as systemd or Kubernetes stop it


class TestSeed000Document:
    def test_the_legacy_nixl_document_runs_as_router_and_stage_workers(self, seed_000: Stages) -> None:
        image = seed_000.image()
        assert image.shape == (64, 64, 3) and image.std() > 0
        router = seed_000.router
        assert router.metric("omni_connector_bytes_total", connector="nixl_ar2dit", direction="put") > 0
        assert (
            router.metric("omni_connector_bytes_total", connector="dit_to_router", direction="get")
            >= 64 * 64 * 3
        )
        assert "legacy stage_args schema" in router.log_text()
        assert "Traceback" not in router.log_text() + seed_000.workers["dit0"].log_text()
