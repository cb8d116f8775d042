"""Serving under Dynamo: Dynamo's real HTTP frontend (``make_engine`` + ``run_input``, what
``python -m dynamo.frontend`` runs) and our workers as processes discovering each other through a folder,
on loopback, in one site and namespace for the module; the run's one ``vllm serve --omni`` of the tiny
GLM-Image (``glm_image_served``) makes the reference images every GLM-Image test compares with (a
generation and a two-image edit).

The pipeline role (``python -m vllm_omni_plugin.dynamo``) serving the whole tiny GLM-Image, then the tiny
BAGEL: the official ``openai`` client gets what ``vllm serve --omni`` gives for the same request (the same
pixels); a bad request is one 400 with our message and one line in the worker's log; a client that goes
away has its request aborted in every stage.

The stage roles (seed 000's shape): a router (``--omni-router``: the orchestrator, the model registered)
and stage workers (``--stage-id N``) as separate processes. The tiny GLM-Image makes the image
``vllm serve --omni`` makes; a DiT worker SIGKILLed under a request leaves the request to another DiT
worker (200), and one started later is used; a client that goes away has its request aborted in the stage
holding it; seed 000's legacy document (NIXL on both hand-overs, ``to_stage_router``) runs as router and
stage workers.

Each deployment registers a served model name of its own and is stopped (SIGTERM, exit 0) at the end of
its class, before the next one starts: they share the namespace's endpoints."""

from __future__ import annotations

import asyncio
import base64
import os
import re
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

from vllm_omni_plugin.processes import SHM_DIR, descendants
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.dynamo import DynamoSite, dynamo_missing
from vllm_omni_testkit.harness.images import pixels, png
from vllm_omni_testkit.harness.served_reference import EDIT_SOURCES, GENERATION
from vllm_omni_testkit.harness.server import (
    ServerProcess,
    wait_for_metric,
)
from vllm_omni_testkit.holds import Hold

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(dynamo_missing() is not None, reason=str(dynamo_missing())),
]

REPO = Path(__file__).resolve().parent.parent
GLM_DEPLOY = REPO / "deploy" / "tiny_glm_image_cpu.yaml"
BAGEL_DEPLOY = REPO / "deploy" / "tiny_bagel_cpu.yaml"
GLM = "tiny-glm-image"
"""The pipeline role's served model name; the stage roles' deployments register their own."""
STAGES_GLM = "tiny-glm-image-stages"
SEED_000_GLM = "tiny-glm-image-seed-000"
BAGEL = "tiny-bagel"
PROMPT = GENERATION["prompt"]
IMAGE = {"seed": GENERATION["seed"], "num_inference_steps": GENERATION["num_inference_steps"]}
"""The generation every GLM-Image deployment is compared on (64x64), with ``vllm serve --omni``'s."""
ENDLESS = 100_000
"""Steps no request finishes while a test holds it (nvext's step count is a u8: these go top-level)."""

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


def uri_pixels(uri: str) -> np.ndarray:
    assert uri.startswith("data:image/png;base64,"), uri[:40]
    return pixels(uri.split(",", 1)[1])


SOURCES = EDIT_SOURCES


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoSite]:
    """Dynamo's frontend; at the end, nothing of this module's left (processes, shared memory)."""
    with DynamoSite.running(tmp_path_factory.mktemp("dynamo")) as site:
        yield site


# The pipeline role


def wait_model(frontend: ServerProcess, name: str, worker: ServerProcess, timeout: float = 900) -> None:
    """Until the frontend lists ``name`` (its worker registered it once its stages were up)."""

    def listed() -> bool:
        if not worker.alive():
            raise AssertionError(f"the worker exited before registering {name}:\n{worker.log_text()[-4000:]}")
        models = http_client.get(frontend.base_url + "/v1/models", timeout=5).json()["data"]
        return any(m["id"] == name for m in models)

    frontend.wait_until(listed, timeout, stop=False)  # the module's frontend: later tests use it


@dataclass
class Served:
    site: DynamoSite
    worker: ServerProcess
    client: openai.OpenAI
    model: str
    reference: dict[str, np.ndarray]

    @property
    def frontend(self) -> ServerProcess:
        return self.site.processes[0]

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return http_client.post(
            self.frontend.base_url + path, json={"model": self.model, **body}, timeout=300
        )


def serve(site: DynamoSite, model: Path, deploy: Path, name: str, *flags: str) -> ServerProcess:
    worker = site.worker(
        model, "--deploy-config", str(deploy), "--served-model-name", name,
        "--image-max-inference-steps", str(ENDLESS), *flags, name=name,
    )  # fmt: skip
    wait_model(site.processes[0], name, worker)
    return worker


@pytest.fixture(scope="class")
def glm(site: DynamoSite, tiny_glm_image: Path, glm_image_served: dict[str, np.ndarray]) -> Iterator[Served]:
    worker = serve(site, tiny_glm_image, GLM_DEPLOY, GLM)
    images = glm_image_served
    client = openai.OpenAI(base_url=site.processes[0].base_url + "/v1", api_key="unused", timeout=300)
    try:
        yield Served(site, worker, client, GLM, images)
    finally:
        client.close()
        site.terminate([worker])


class TestGlmImage:
    def test_the_openai_client_gets_the_image_vllm_serve_makes(self, glm: Served) -> None:
        for extra in (
            {"nvext": {"seed": 11, "num_inference_steps": 4}},
            {"seed": 11, "num_inference_steps": 4},
        ):
            made = glm.client.images.generate(model=GLM, prompt=PROMPT, size="64x64", extra_body=extra)
            image = pixels(made.data[0].b64_json)
            assert image.shape == (64, 64, 3)
            np.testing.assert_array_equal(image, glm.reference["generation"])
        assert made.size == "64x64" and made.created > 0

    def test_chat_answers_with_the_image_streamed_or_not(self, glm: Served) -> None:
        settings = {"chat_template_kwargs": {"size": "64x64", "num_inference_steps": 4}}
        messages = [{"role": "user", "content": PROMPT}]
        chat = glm.client.chat.completions.create(model=GLM, messages=messages, seed=11, extra_body=settings)
        (part,) = chat.choices[0].message.content
        np.testing.assert_array_equal(uri_pixels(part["image_url"]["url"]), glm.reference["generation"])
        chunks = list(
            glm.client.chat.completions.create(
                model=GLM, messages=messages, seed=11, extra_body=settings, stream=True
            )
        )
        parts = [p for c in chunks for choice in c.choices for p in (choice.delta.content or [])]
        assert len(parts) == 1 and chunks[-1].choices[-1].finish_reason == "stop"
        np.testing.assert_array_equal(uri_pixels(parts[0]["image_url"]["url"]), glm.reference["generation"])

    def test_an_edit_takes_input_reference_and_more_images(self, glm: Served) -> None:
        uris = ["data:image/png;base64," + base64.b64encode(png(s)).decode() for s in SOURCES]
        edited = glm.post(
            "/v1/images/edits",
            {"prompt": "make it blue", "input_reference": uris[0], "images": uris[1:],
             "nvext": {"seed": 5, "num_inference_steps": 4}},
        )  # fmt: skip
        assert edited.status_code == 200, edited.text
        np.testing.assert_array_equal(pixels(edited.json()["data"][0]["b64_json"]), glm.reference["edit"])

    def test_a_bad_request_is_one_400_with_our_message_and_one_log_line(self, glm: Served) -> None:
        with pytest.raises(openai.BadRequestError) as caught:
            glm.client.images.generate(model=GLM, prompt=PROMPT, size="65x64")
        message = "width and height must be multiples of 32 and at least 32 pixels, got 65x64"
        assert caught.value.status_code == 400 and message in caught.value.response.text
        refused = glm.post("/v1/images/generations", {"prompt": PROMPT, "response_format": "url"})
        assert refused.status_code == 400 and "not served under Dynamo" in refused.text
        streamed = glm.post("/v1/images/generations", {"prompt": PROMPT, "stream": True})
        assert streamed.status_code == 400 and "not streamed through it" in streamed.text
        log = glm.worker.log_text()
        lines = [line for line in log.splitlines() if message in line and "failed (400)" in line]
        assert len(lines) == 1 and re.search(r"request \S+ \(images/generations\) failed \(400\)", lines[0])
        assert "Traceback" not in log

    def test_a_client_that_goes_away_is_aborted_in_every_stage(self, glm: Served) -> None:
        worker = glm.worker
        body = {"model": GLM, "prompt": "a painting nobody waits for", "size": "64x64", "seed": 3,
                "num_inference_steps": ENDLESS}  # fmt: skip
        for point, stage, where in (("ar.step", "0", "engine"), ("dit.step", "1", "batch")):
            drops = worker.metric("omni_stage_aborted_requests_total", stage=stage, where=where)
            gone = worker.metric("omni_client_disconnects_total")

            async def main(point: str = point) -> None:
                async with httpx.AsyncClient(base_url=glm.frontend.base_url, timeout=600) as client:
                    with worker.hold(point) as hold:  # the request is inside the stage
                        work = asyncio.ensure_future(client.post("/v1/images/generations", json=body))
                        await asyncio.to_thread(hold.wait, alive=worker.alive)
                        work.cancel()  # the client closes its connection
                        with pytest.raises(asyncio.CancelledError):
                            await work

            asyncio.run(main())
            wait_for_metric(
                lambda sample, stage=stage, where=where: worker.metric(sample, stage=stage, where=where),
                "omni_stage_aborted_requests_total",
                drops + 1,
            )
            assert worker.metric("omni_client_disconnects_total") == gone + 1
        steps = worker.metric("omni_diffusion_denoise_steps_total")
        time.sleep(1.0)  # dropped from the DiT's batch, not run on
        assert worker.metric("omni_diffusion_denoise_steps_total") == steps
        made = glm.client.images.generate(
            model=GLM,
            prompt=PROMPT,
            size="64x64",
            extra_body={"nvext": {"seed": 11, "num_inference_steps": 4}},
        )
        np.testing.assert_array_equal(pixels(made.data[0].b64_json), glm.reference["generation"])


@pytest.fixture(scope="class")
def bagel(site: DynamoSite, tiny_bagel: Path) -> Iterator[Served]:
    worker = serve(site, tiny_bagel, BAGEL_DEPLOY, BAGEL)
    client = openai.OpenAI(base_url=site.processes[0].base_url + "/v1", api_key="unused", timeout=300)
    try:
        yield Served(site, worker, client, BAGEL, {})
    finally:
        client.close()
        site.terminate([worker])


class TestBagel:
    def test_chat_answers_with_an_image_and_in_text(self, bagel: Served) -> None:
        messages = [{"role": "user", "content": "a lighthouse at dusk"}]
        settings = {"size": "64x64", "num_inference_steps": 4, "cfg_text_scale": 4.0}
        chat = bagel.client.chat.completions.create(
            model=BAGEL, messages=messages, seed=2, extra_body={"chat_template_kwargs": settings}
        )
        (part,) = chat.choices[0].message.content
        assert uri_pixels(part["image_url"]["url"]).shape == (64, 64, 3)
        answer = bagel.client.chat.completions.create(
            model=BAGEL, messages=messages, max_tokens=8, temperature=0, extra_body={"modalities": ["text"]}
        )
        assert isinstance(answer.choices[0].message.content, str) and answer.choices[0].message.content
        assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 8
        streamed = bagel.client.chat.completions.create(
            model=BAGEL, messages=messages, max_tokens=8, temperature=0, stream=True,
            extra_body={"modalities": ["text"]},
        )  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == answer.choices[0].message.content


# The stage roles


@dataclass
class Stages:
    site: DynamoSite
    router: ServerProcess
    workers: dict[str, ServerProcess]
    argv: list[str]
    client: openai.OpenAI
    model: str
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
        self.workers[name] = self.site.worker(
            *self.argv, "--stage-id", str(stage), name=f"{self.model}-{name}"
        )
        return self.workers[name]

    def image(self, prompt: str = PROMPT, **extra: Any) -> np.ndarray:
        made = self.client.images.generate(
            model=self.model, prompt=prompt, size="64x64", extra_body={**IMAGE, **extra}
        )
        return pixels(made.data[0].b64_json)

    def stop(self) -> None:
        self.client.close()
        running = [p for p in (self.router, *self.workers.values()) if p.alive()]  # not the killed
        self.site.terminate(running)


def deploy_stages(site: DynamoSite, argv: list[str], model: str, dits: int) -> Stages:
    # the workers' log files are named after the deployment: each class's are kept
    router = site.worker(*argv, "--omni-router", "--served-model-name", model,
                         "--image-max-inference-steps", str(ENDLESS), name=f"{model}-router")  # fmt: skip
    client = openai.OpenAI(base_url=site.processes[0].base_url + "/v1", api_key="unused", timeout=300)
    stages = Stages(site, router, {}, argv, client, model, None)
    stages.start_worker("ar", 0)
    for i in range(dits):
        stages.start_worker(f"dit{i}", 1)
    stages.wait_joined(0, 1)
    stages.wait_joined(1, dits)
    frontend = site.processes[0]
    try:
        frontend.wait_until(
            lambda: any(
                m["id"] == model
                for m in http_client.get(frontend.base_url + "/v1/models", timeout=5).json()["data"]
            ),
            600,
            stop=False,  # the module's frontend: the other classes' deployments use it
        )
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\nthe router's log tail:\n{router.log_text()[-4000:]}") from None
    return stages


@pytest.fixture(scope="class")
def stages(
    site: DynamoSite, tiny_glm_image: Path, glm_image_served: dict[str, np.ndarray]
) -> Iterator[Stages]:
    deployed = deploy_stages(site, [str(tiny_glm_image), "--deploy-config", str(GLM_DEPLOY)], STAGES_GLM, 2)
    try:
        deployed.reference = glm_image_served["generation"]
        yield deployed
    finally:
        deployed.stop()


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
        body = {"model": stages.model, "prompt": "a painting nobody waits for", "size": "64x64", "seed": 3,
                "num_inference_steps": ENDLESS}  # fmt: skip
        frontend = stages.site.processes[0]
        dits = [w for n, w in stages.workers.items() if n.startswith("dit") and w.alive()]
        for stage, point, where, workers in (("0", "ar.step", "engine", [stages.workers["ar"]]),
                                             ("1", "dit.step", "batch", dits)):  # fmt: skip
            drops = stages.router.metric("omni_stage_aborted_requests_total", stage=stage, where=where)
            gone = stages.router.metric("omni_client_disconnects_total")

            async def main(
                point: str = point,
                workers: list[ServerProcess] = workers,
                stage: str = stage,
                where: str = where,
            ) -> str:
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
                        if where == "engine":
                            # Held until the AR worker has dropped it (counted as its request is cancelled,
                            # before the engine's own abort): released earlier, the request could leave the
                            # engine for the DiT before the abort reached the worker. The DiT's drop is
                            # counted after the held step, and its endless request cannot leave meanwhile.
                            await asyncio.to_thread(
                                wait_for_metric,
                                lambda sample: workers[int(held)].metric(sample, stage=stage, where=where),
                                "omni_stage_aborted_requests_total",
                                1,
                                at_least=True,
                            )
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
    deployed = deploy_stages(
        site, [str(tiny_glm_image), "--stage-configs-path", str(document)], SEED_000_GLM, 1
    )
    try:
        yield deployed
    finally:
        deployed.stop()


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
