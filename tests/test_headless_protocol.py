"""The head's side of headless stages over real ZMQ sockets: registration, refusals, heartbeats, progress, a
lost worker (its requests fail with StageDeadError, the stage waits for a rejoin) and head shutdown. The
"worker" here is a bare DEALER socket speaking the protocol, so each rule is checked on its own; the
two-namespace test runs the real worker end to end."""

from __future__ import annotations

import asyncio
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from helpers import HeadlessPeer
from vllm_omni_plugin.config import PLATFORMS, resolve_deployment
from vllm_omni_plugin.connectors.base import InProcessConnector
from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_plugin.stage.core_client import StageState
from vllm_omni_plugin.stage.core_types import StageAbort, StageDiffusionCoreOutput, StageDiffusionCoreRequest
from vllm_omni_plugin.stage.errors import StageDeadError, StageError
from vllm_omni_plugin.stage.placement.headless.head import HeadlessStageRegistry, RemoteStageClient
from vllm_omni_plugin.stage.placement.headless.protocol import (
    HeadMessage,
    HeadShutdown,
    Heartbeat,
    RemoteRequest,
    WorkerAccepted,
    WorkerProgress,
    WorkerRejected,
    parse_head_address,
)
from vllm_omni_plugin.stage.placement.wire import RemoteOutput
from vllm_omni_plugin.stage.serialization import StageMessageCodec
from vllm_omni_testkit.harness.server import free_port


@pytest.fixture
def deployment(tmp_path: Path):
    model = tmp_path / "glm-image"
    model.mkdir()
    (model / "model_index.json").write_text('{"_class_name": "GlmImagePipeline"}')
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        textwrap.dedent(f"""
        pipeline: glm_image
        head: {{host: 127.0.0.1, port: {free_port()}, heartbeat_interval_s: 0.1, heartbeat_timeout_s: 0.6}}
        stages: [{{stage_id: 1, headless: true}}]
        """)
    )
    return resolve_deployment(str(model), deploy_config=str(deploy), platform=PLATFORMS["cpu"])


async def start(deployment) -> tuple[HeadlessStageRegistry, RemoteStageClient, zmq.asyncio.Context]:
    client = RemoteStageClient(1, "dit")
    registry = HeadlessStageRegistry(deployment, {1: client})
    await registry.start()
    return registry, client, zmq.asyncio.Context()


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Until the head's receive loop has handled what was sent."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def request(request_id: str) -> StageDiffusionCoreRequest:
    return StageDiffusionCoreRequest(request_id=request_id, stage_id=1, diffusion={"prompt": "x"})


def test_registration_refusals_and_a_round_trip(deployment) -> None:
    async def main() -> None:
        registry, client, context = await start(deployment)
        try:
            assert client.awaits_worker and client.state == StageState.STARTING
            stranger = HeadlessPeer(context, registry.address)
            await stranger.send(stranger.register(deployment, digest="0" * 16))
            refused = await stranger.receive()
            assert isinstance(refused, WorkerRejected) and "same file" in refused.reason

            worker = HeadlessPeer(context, registry.address)
            await worker.send(worker.register(deployment))
            accepted = await worker.receive()
            assert isinstance(accepted, WorkerAccepted) and accepted.heartbeat_timeout_s == 0.6
            await worker.send(worker.register(deployment))  # a repeated registration changes nothing
            assert isinstance(await worker.receive(), WorkerAccepted)
            assert client.healthy and client.joins == 1 and client.pid == 4242

            second = HeadlessPeer(context, registry.address)
            await second.send(second.register(deployment, pid=99))
            busy = await second.receive()
            assert isinstance(busy, WorkerRejected) and "already served by" in busy.reason

            async def serve_one(error_kind: str | None) -> None:
                message = await worker.receive()
                assert isinstance(message, RemoteRequest)
                rid = message.request.request_id
                if error_kind is None:
                    output = StageDiffusionCoreOutput(request_id=rid, stage_id=1, image=[[1]])
                    await worker.send(RemoteOutput(request_id=rid, output=output))
                else:
                    await worker.send(RemoteOutput(request_id=rid, error="boom", error_kind=error_kind))

            answered = asyncio.ensure_future(serve_one(None))
            output = await client.generate(request("r1"))
            await answered
            assert output.image == [[1]] and "transfer_put" in output.timings
            for kind, exc in (("dead", StageDeadError), ("stage", StageError)):
                answered = asyncio.ensure_future(serve_one(kind))
                with pytest.raises(exc, match="boom"):
                    await client.generate(request(f"r-{kind}"))
                await answered

            # A cancelled request is aborted on the worker too.
            task = asyncio.ensure_future(client.generate(request("r-abort")))
            assert isinstance(await worker.receive(), RemoteRequest)
            task.cancel()
            abort = await worker.receive()
            assert isinstance(abort, StageAbort) and abort.request_ids == ["r-abort"]
        finally:
            await registry.shutdown()
            context.destroy(linger=0)

    asyncio.run(main())


def test_silent_worker_fails_its_requests_and_a_new_one_rejoins(deployment) -> None:
    async def main() -> None:
        registry, client, context = await start(deployment)
        try:
            worker = HeadlessPeer(context, registry.address)
            await worker.send(worker.register(deployment))
            assert isinstance(await worker.receive(), WorkerAccepted)
            await worker.send(WorkerProgress(counters=DiffusionCounters(denoise_steps=7)))
            await until(lambda: client.denoise_steps == 7)
            # The request's inputs travel through the head's connector (the worker never reads them, as
            # when its acknowledgement is lost with it) ...
            client.input_connector = InProcessConnector("ar_to_dit")
            lost = StageDiffusionCoreRequest(
                request_id="lost", stage_id=1, diffusion={"prompt": "x", "tokens": torch.arange(6)}
            )
            pending = asyncio.ensure_future(client.generate(lost))
            assert isinstance(await worker.receive(), RemoteRequest)
            assert client.input_connector.health().outstanding == 1
            # ... and the worker says nothing more: after heartbeat_timeout_s the head gives up on it,
            # and frees what it put for the lost request.
            with pytest.raises(StageDeadError, match="waiting for the worker to rejoin"):
                await asyncio.wait_for(pending, 10)
            assert client.input_connector.health().outstanding == 0
            assert client.state == StageState.RESTARTING and client.awaits_worker
            with pytest.raises(StageDeadError, match="no worker registered"):
                await client.generate(request("meanwhile"))

            # The lost worker's late messages are refused; a restarted worker (new socket) rejoins.
            await worker.send(WorkerProgress(counters=DiffusionCounters(denoise_steps=9)))
            assert isinstance(await worker.receive(), WorkerRejected)
            assert client.denoise_steps == 7
            again = HeadlessPeer(context, registry.address)
            await again.send(again.register(deployment, pid=5151))
            assert isinstance(await again.receive(), WorkerAccepted)
            assert client.healthy and client.restarts == 1 and client.pid == 5151
            # the new worker counts its steps from 0: the head's count goes on from the lost one's
            await again.send(WorkerProgress(counters=DiffusionCounters(denoise_steps=3)))
            await until(lambda: client.denoise_steps == 10)

            await registry.shutdown()
            assert isinstance(await again.receive(), HeadShutdown)
        finally:
            await registry.shutdown()
            context.destroy(linger=0)

    asyncio.run(main())


def test_a_silent_worker_is_given_up_even_where_every_tick_of_the_head_comes_late(deployment) -> None:
    """The head's loop held up longer than the heartbeat timeout at every tick (a busy host, a thread
    holding the GIL): a late tick is not the worker's fault, but a worker silent for that many ticks is
    given up all the same, so its request gets its 503 instead of waiting for ever."""

    async def main() -> None:
        registry, client, context = await start(deployment)
        stalls = 0

        async def stall_every_tick() -> None:
            nonlocal stalls
            while True:
                time.sleep(0.8)  # blocks the loop past heartbeat_timeout_s (0.6)
                stalls += 1
                await asyncio.sleep(0.05)

        staller: asyncio.Task | None = None
        try:
            worker = HeadlessPeer(context, registry.address)
            await worker.send(worker.register(deployment))
            assert isinstance(await worker.receive(), WorkerAccepted)
            pending = asyncio.ensure_future(client.generate(request("lost")))
            assert isinstance(await worker.receive(), RemoteRequest)
            # its last word, read by the head at the latest after the first stall: from there on every
            # tick of the head comes after a stall (its next tick is due after the staller's next stall)
            await worker.send(Heartbeat())
            staller = asyncio.ensure_future(stall_every_tick())
            with pytest.raises(StageDeadError, match="sent nothing for"):
                await asyncio.wait_for(pending, 60)
            assert stalls >= client.silence.ticks_needed - 1
        finally:
            if staller is not None:
                staller.cancel()
            await registry.shutdown()
            context.destroy(linger=0)

    asyncio.run(main())


def test_busy_head_port_is_a_clear_start_error(deployment) -> None:
    from vllm_omni_plugin.stage.errors import StageStartError

    async def main() -> None:
        first, _client, context = await start(deployment)
        try:
            with pytest.raises(StageStartError, match=r"set head.port in the deploy config to a free port"):
                await HeadlessStageRegistry(deployment, {1: RemoteStageClient(1, "dit")}).start()
        finally:
            await first.shutdown()
            context.destroy(linger=0)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("10.0.0.1:29600", ("10.0.0.1", 29600)), ("[fe80::1]:5", ("fe80::1", 5)), ("head:1", ("head", 1))],
)
def test_head_address(text: str, parsed: tuple[str, int]) -> None:
    assert parse_head_address(text) == parsed


@pytest.mark.parametrize("text", ["10.0.0.1", ":29600", "host:0", "host:x", "host:70000"])
def test_bad_head_address(text: str) -> None:
    with pytest.raises(ValueError, match="expected ADDR:PORT"):
        parse_head_address(text)


def test_messages_round_trip() -> None:
    codec = StageMessageCodec(HeadMessage)
    message = RemoteRequest(request=request("a"))
    assert codec.decode(StageMessageCodec(HeadMessage).encode(message)) == message
    assert msgspec.json.decode(msgspec.json.encode(HeadShutdown()), type=HeadMessage) == HeadShutdown()
