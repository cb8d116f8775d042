"""Helpers shared by the test modules (fixtures live in ``conftest.py``).

Besides small helpers (a source image, a handle through the wire, our shared-memory segments), this is
the stage runtime without engines: :class:`FakeStageClient` is a replica that answers in this process,
a ``StageCoreClientBase`` like every real client, and :data:`FAKE_PIPELINE` a two-stage pipeline whose
stage-input processors need no model. :class:`FakePlacement` puts every replica of a resolved deployment
on fake clients, through the placement interface the runtime uses; :func:`app_client` serves the API app
over such a runtime. :func:`run_result_script` and :func:`run_output_script` run a script (an engine
script, or a test module run as one) in a process of its own, so that a vLLM engine's global state stays
out of pytest's: a fork of the session's fork server where it can be (``vllm_omni_testkit.harness.forks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from vllm_omni_plugin.config import (
    PLATFORMS,
    DiffusionDefaults,
    Pipeline,
    PipelineStage,
    ResolvedDeployment,
    register_pipeline,
    resolve_deployment,
)
from vllm_omni_plugin.config.resolved import ResolvedStage
from vllm_omni_plugin.connectors.base import ConnectorHandle, OmniConnector
from vllm_omni_plugin.families.glm_image.runner import GlmImageRequest
from vllm_omni_plugin.stage.core_client import StageCoreClientBase, StageState
from vllm_omni_plugin.stage.core_types import (
    StageCoreOutput,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    StageLLMCoreOutput,
    StageLLMCoreRequest,
)
from vllm_omni_plugin.stage.errors import StageDeadError
from vllm_omni_plugin.stage.orchestrator import ProcessorContext
from vllm_omni_plugin.stage.placement.base import StagePlacement
from vllm_omni_plugin.stage.placement.headless.protocol import (
    HeadMessage,
    Heartbeat,
    WorkerMessage,
    WorkerRegister,
    stage_config_digest,
)
from vllm_omni_plugin.stage.serialization import StageMessageCodec
from vllm_omni_testkit.harness.forks import run_to_end
from vllm_omni_testkit.harness.images import pixels
from vllm_omni_testkit.harness.leaks import LeakWatch
from vllm_omni_testkit.harness.server import ServerProcess, cpu_test_env, omni_server

if TYPE_CHECKING:
    import httpx
    import torch

    from vllm_omni_plugin.entrypoints.omni_server import OmniServer

SHM_DIR = "/dev/shm"
ENGINE_SCRIPTS = Path(__file__).parent / "engine_scripts"


# --- small helpers ------------------------------------------------------------------------------------


def source_image(side: int = 64, seed: int = 0) -> np.ndarray:
    """A random uint8 ``side`` x ``side`` RGB image (the same for the same seed)."""
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


def wire(handle: ConnectorHandle) -> bytes:
    """A handle as a stage sends it in a control message."""
    return msgspec.msgpack.encode(msgspec.to_builtins(handle))


def unwire(data: bytes) -> ConnectorHandle:
    """A handle as the receiving stage reads it from a control message."""
    return msgspec.convert(msgspec.msgpack.decode(data), ConnectorHandle)


def our_segments_left(watch: LeakWatch, grace: float = 30.0) -> list[str]:
    """The ``vllm_omni_*`` segments the watched processes made or mapped and left behind (after up to
    ``grace`` s); another test run's on the same machine are not theirs."""
    watch.stop()
    return [name for name in watch.leftovers(grace).segments if name.startswith("vllm_omni_")]


def our_segments(pids: set[int] | None = None) -> list[str]:
    """Our shared-memory segments (``vllm_omni_*``), those of ``pids`` only when given."""
    names = [name for name in os.listdir(SHM_DIR) if name.startswith("vllm_omni_")]
    if pids is not None:
        names = [n for n in names if any(n.startswith(f"vllm_omni_{pid}_") for pid in pids)]
    return sorted(names)


# --- the stage runtime without engines ---------------------------------------------------------------

Answer = Callable[[Any], StageCoreOutput | Awaitable[StageCoreOutput]]
"""What a fake replica does with a request: return (or await) its output, or raise."""


class FakeStageClient(StageCoreClientBase):
    """A replica that answers through ``answer`` in this process; it implements ``StageCoreClientBase``
    and nothing more, so whatever works with it needs nothing beyond that interface."""

    def __init__(self, stage_id: int, replica_id: int, name: str, answer: Answer, *, pid: int | None = None):
        super().__init__(stage_id, replica_id, name)
        self.answer = answer
        self.fake_pid = pid
        self.start_error: BaseException | None = None
        self.aborted: list[str] = []
        self.cancelled: list[str] = []
        self.served: list[str] = []
        self.shutdowns = 0

    @property
    def pid(self) -> int | None:
        return self.fake_pid if self.healthy else None

    async def start(self) -> None:
        if self.start_error is not None:
            raise self.start_error
        self.state = StageState.READY

    async def generate(self, request: Any) -> StageCoreOutput:
        if not self.healthy:
            raise StageDeadError(f"{self.label} is {self.state.value}", stage_id=self.stage_id)
        self.inflight.add(request.request_id)
        try:
            output = self.answer(request)
            if inspect.isawaitable(output):
                output = await output
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.inflight.discard(request.request_id)
        self.served.append(request.request_id)
        return output

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    async def shutdown(self) -> None:
        self.shutdowns += 1
        self.state = StageState.STOPPED


def ar_answer(request: StageLLMCoreRequest) -> StageLLMCoreOutput:
    """The fake AR stage: its prompt's ids, reversed."""
    return StageLLMCoreOutput(
        request_id=request.request_id,
        stage_id=request.stage_id,
        token_ids=list(reversed(request.prompt_token_ids)),
        finish_reason="length",
        timings={"ar": 0.001},
    )


def dit_answer(request: StageDiffusionCoreRequest) -> StageDiffusionCoreOutput:
    """The fake DiT stage: a flat grey image of the requested size."""
    diffusion: GlmImageRequest = request.diffusion
    image = np.full((diffusion.height or 64, diffusion.width or 64, 3), 127, dtype=np.uint8)
    return StageDiffusionCoreOutput(
        request_id=request.request_id, stage_id=request.stage_id, image=image, timings={"denoise": 0.001}
    )


def fake_prompt_ids(sources: dict[int, Any], context: ProcessorContext) -> StageLLMCoreRequest:
    """Stage-input processor of the fake AR stage: one id per prompt character."""
    request = context.request
    if not request.prompt:
        raise ValueError("the prompt is empty")
    return StageLLMCoreRequest(
        request_id=request.request_id,
        stage_id=context.stage_id,
        prompt_token_ids=[ord(c) % 256 for c in request.prompt],
        sampling_params=dict(request.sampling_params),
    )


def fake_ids_to_image(sources: dict[int, Any], context: ProcessorContext) -> StageDiffusionCoreRequest:
    """Stage-input processor of the fake DiT stage: the AR ids as the prior, sized like the request."""
    request = context.request
    diffusion = request.runner_request(GlmImageRequest, prior_token_ids=list(sources[0].token_ids))
    return StageDiffusionCoreRequest(
        request_id=request.request_id, stage_id=context.stage_id, diffusion=diffusion
    )


FAKE_PIPELINE = Pipeline(
    name="fake_two_stage",
    stages=(
        PipelineStage(
            stage_id=0, name="ar", execution_type="llm_ar", input_processor=f"{__name__}.fake_prompt_ids"
        ),
        PipelineStage(
            stage_id=1,
            name="dit",
            execution_type="diffusion",
            input_sources=(0,),
            input_processor=f"{__name__}.fake_ids_to_image",
            output_type="image",
            final_output=True,
        ),
    ),
    diffusion_defaults=DiffusionDefaults(height=64, width=64),
)
register_pipeline(FAKE_PIPELINE)


def fake_deployment(
    tmp_path: Path, deploy: str = "", pipeline: str = FAKE_PIPELINE.name
) -> ResolvedDeployment:
    """``FAKE_PIPELINE`` (or ``pipeline``, one registered over the same fake stages) resolved on CPU from a
    deploy config (``deploy``: more YAML after the pipeline)."""
    model = tmp_path / "fake-model"
    model.mkdir(exist_ok=True)
    path = tmp_path / "fake_deploy.yaml"
    path.write_text(f"pipeline: {pipeline}\n" + textwrap.dedent(deploy))
    return resolve_deployment(str(model), deploy_config=str(path), platform=PLATFORMS["cpu"])


class FakePlacement(StagePlacement):
    """A placement that puts every replica on a :class:`FakeStageClient` (answers by execution type)
    and remembers the clients it made."""

    def __init__(self, answers: dict[int, Answer] | None = None) -> None:
        self.answers = answers or {}
        self.clients: dict[int, list[FakeStageClient]] = {}

    def place(
        self, deployment: ResolvedDeployment, stage: ResolvedStage, connectors: dict[str, OmniConnector]
    ) -> list[StageCoreClientBase]:
        default = ar_answer if stage.execution_type == "llm_ar" else dit_answer
        answer = self.answers.get(stage.stage_id, default)
        made = [
            FakeStageClient(
                stage.stage_id, r.replica_id, stage.name, answer, pid=10_000 + 10 * stage.stage_id + i
            )
            for i, r in enumerate(stage.replicas)
        ]
        self.clients[stage.stage_id] = made
        return list(made)

    async def start(self) -> None:
        """Nothing beyond the fake clients."""

    def abandon(self) -> None:
        """Nothing outside this process."""

    async def shutdown(self) -> None:
        """Nothing beyond the fake clients."""

    def health(self) -> dict[str, Any]:
        return {}


@contextlib.asynccontextmanager
async def app_client(
    deployment: ResolvedDeployment, placement: FakePlacement, *flags: str, timeout: float = 5.0
) -> AsyncIterator[tuple[httpx.AsyncClient, OmniServer]]:
    """The API app of ``vllm serve MODEL --omni *flags`` over a started runtime of ``placement``'s replicas,
    and an HTTP client of it (``timeout``: the client's, httpx's default unless given); the runtime is
    shut down on the way out."""
    import httpx

    from vllm_omni_plugin.entrypoints.api_server import build_api_app
    from vllm_omni_plugin.entrypoints.cli import build_parser
    from vllm_omni_plugin.entrypoints.omni_server import OmniServer, settings_from_args
    from vllm_omni_plugin.stage.async_omni import AsyncOmni

    args = build_parser().parse_args(["serve", deployment.model, "--omni", *flags])
    omni = AsyncOmni(deployment, placement=placement)
    await omni.start()
    server = OmniServer(omni, settings_from_args(args, deployment))
    try:
        transport = httpx.ASGITransport(app=build_api_app(args, server))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://omni.test", timeout=timeout
        ) as client:
            yield client, server
    finally:
        server.close()
        await omni.shutdown()


# --- scripts in a process of their own ------------------------------------------------------------------


def _run_script(
    path: Path | str, args: tuple[str, ...], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python path *args`` with the CPU test environment (plus ``env``), its vLLM engine core and worker
    in that one process (a child's threads and global state never reach pytest's process): a fork of the
    session's fork server where it can be one (vLLM, torch and diffusers imported), else fresh."""
    argv = [sys.executable, str(path), *args]
    return run_to_end(argv, cpu_test_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}), timeout)


def _ends(result: subprocess.CompletedProcess[str]) -> str:
    """The ends of a failed script's output, for the assertion message."""
    return result.stdout[-3000:] + result.stderr[-6000:]


def run_result_script(
    path: Path | str, *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> Any:
    """Runs a script that prints its findings as one ``RESULT {json}`` line; returns them (the last such
    line). The script must exit 0."""
    result = _run_script(path, args, timeout, env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, _ends(result)
    return json.loads(lines[-1].removeprefix("RESULT "))


def run_output_script(
    path: Path | str, *args: str, out: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Runs a script whose last argument is an output path ``out``, to which it writes ``<out>.json`` and,
    for tensors too large for a line of output, ``<out>.safetensors``; returns what both hold."""
    from safetensors.torch import load_file

    result = _run_script(path, (*args, str(out)), timeout, env)
    assert result.returncode == 0, _ends(result)
    return json.loads(Path(f"{out}.json").read_text()), load_file(f"{out}.safetensors")


class HeadlessPeer:
    """A headless worker's socket, speaking the protocol to a head by hand."""

    def __init__(self, context: zmq.asyncio.Context, address: str) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.out = StageMessageCodec(WorkerMessage)
        self.into = StageMessageCodec(HeadMessage)

    async def send(self, message: object) -> None:
        await self.socket.send(self.out.encode(message))

    async def receive(self, skip_heartbeats: bool = True, timeout: float = 5.0) -> object:
        while True:
            message = self.into.decode(await asyncio.wait_for(self.socket.recv(), timeout))
            if not (skip_heartbeats and isinstance(message, Heartbeat)):
                return message

    def register(self, deployment: Any, digest: str | None = None, pid: int = 4242) -> WorkerRegister:
        return WorkerRegister(
            stage_id=1,
            worker_id=f"w{pid}",
            host="worker-host",
            pid=pid,
            config_digest=digest or stage_config_digest(deployment, 1),
        )


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` pixels and holds none: what Image.open reads of it (a
    hostile upload's dimensions without its bytes)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def serve_model(
    model: Path, deploy: Path, directory: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """``vllm serve MODEL --omni --deploy-config DEPLOY`` on a free port of this host, ready; stopped on the
    way out (module fixtures ``yield from`` it)."""
    with omni_server(model, deploy, directory / "server.log", *extra, env=env) as server:
        yield server


def assert_streamed(events: list[Any], prefix: str, previews: int, plain: np.ndarray) -> list[Any]:
    """A streamed image answer (the ``openai`` client's events): its previews then its completed image,
    equal to the image not streamed (``plain``); returns the events before the first preview."""
    kinds = [event.type for event in events]
    first = kinds.index(f"{prefix}.partial_image")
    partial = [e for e in events if e.type == f"{prefix}.partial_image"]
    assert [e.partial_image_index for e in partial] == list(range(previews))
    assert kinds[-1] == f"{prefix}.completed" and kinds.count(f"{prefix}.completed") == 1
    assert kinds[first : first + previews] == [f"{prefix}.partial_image"] * previews
    completed = events[-1]
    np.testing.assert_array_equal(pixels(completed.b64_json), plain)
    for event in partial:
        assert pixels(event.b64_json).shape == plain.shape and event.size == completed.size
    return events[:first]


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> None:
    """Polls ``condition`` until it holds; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
