"""The placement interface: every implementation declares all of it, the factory picks each stage's kind,
and a deployment that mixes kinds (a headless stage beside stages of this host) runs through ``AsyncOmni``
by that interface alone: a real head over ZMQ, a worker speaking the protocol by hand, fake local replicas."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

import vllm_omni_plugin.stage.placement as placement_package
from helpers import FakePlacement, HeadlessPeer, fake_deployment
from vllm_omni_plugin.config import ResolvedDeployment
from vllm_omni_plugin.dynamo.placement import DynamoPlacement
from vllm_omni_plugin.stage.async_omni import AsyncOmni
from vllm_omni_plugin.stage.core_types import StageDiffusionCoreOutput
from vllm_omni_plugin.stage.errors import StageStartError
from vllm_omni_plugin.stage.factory import placement_for
from vllm_omni_plugin.stage.orchestrator import OmniRequest
from vllm_omni_plugin.stage.placement.base import PerStagePlacement, StagePlacement
from vllm_omni_plugin.stage.placement.headless.head import HeadlessPlacement, RemoteStageClient
from vllm_omni_plugin.stage.placement.headless.protocol import (
    HeadShutdown,
    RemoteRequest,
    WorkerAccepted,
    WorkerRegister,
    stage_config_digest,
)
from vllm_omni_plugin.stage.placement.local.placement import LocalPlacement
from vllm_omni_plugin.stage.placement.ray.head import RayPlacement
from vllm_omni_plugin.stage.placement.wire import RemoteOutput
from vllm_omni_testkit.harness.server import free_port


def folder(tmp_path: Path, name: str) -> Path:
    (tmp_path / name).mkdir()
    return tmp_path / name


def headless_deployment(tmp_path: Path, port: int | None = None) -> ResolvedDeployment:
    """The fake two-stage pipeline with its DiT (stage 1) on a headless worker."""
    return fake_deployment(
        tmp_path,
        f"""
        head: {{host: 127.0.0.1, port: {port or free_port()}, heartbeat_interval_s: 0.1, heartbeat_timeout_s: 5}}
        stages: [{{stage_id: 1, headless: true}}]
        """,
    )


def implementations() -> set[type[StagePlacement]]:
    """Every ``StagePlacement`` of the package (each module of ``stage/placement/`` and Dynamo's placement
    imported; Ray and Dynamo themselves are not)."""
    for module in pkgutil.walk_packages(placement_package.__path__, placement_package.__name__ + "."):
        importlib.import_module(module.name)
    importlib.import_module("vllm_omni_plugin.dynamo.placement")
    found: set[type[StagePlacement]] = set()
    todo = list(StagePlacement.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("vllm_omni_plugin."):
            found.add(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_every_placement_implements_the_interface(tmp_path: Path) -> None:
    local = fake_deployment(folder(tmp_path, "local"))
    ray = fake_deployment(folder(tmp_path, "ray"), "backend: ray\n")
    made = {
        LocalPlacement: LocalPlacement(),
        HeadlessPlacement: HeadlessPlacement(local),
        RayPlacement: RayPlacement(ray),
        PerStagePlacement: PerStagePlacement(LocalPlacement(), {1: HeadlessPlacement(local)}),
        DynamoPlacement: DynamoPlacement(local, None, "ns.backend-stage{}.generate".format),  # no runtime yet
    }
    assert implementations() == set(made)  # a new placement must be added here
    for cls, placement in made.items():  # instantiating proves that nothing abstract is left
        assert isinstance(placement, StagePlacement) and type(placement) is cls
    assert made[LocalPlacement].health() == {}
    assert made[RayPlacement].health() == {"ray": {"head_node": None, "actors": 0}}
    assert made[DynamoPlacement].health() == {"dynamo": {}}

    class Partial(StagePlacement):  # what the check catches: a placement that forgot part of it
        def place(self, deployment: Any, stage: Any, connectors: Any) -> list[Any]:
            return []

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_the_factory_picks_each_stages_placement(tmp_path: Path) -> None:
    assert type(placement_for(fake_deployment(folder(tmp_path, "local")))) is LocalPlacement
    assert type(placement_for(fake_deployment(folder(tmp_path, "ray"), "backend: ray\n"))) is RayPlacement
    mixed = placement_for(headless_deployment(folder(tmp_path, "mixed")))
    assert isinstance(mixed, PerStagePlacement) and type(mixed.default) is LocalPlacement
    assert set(mixed.by_stage) == {1} and type(mixed.by_stage[1]) is HeadlessPlacement


def test_a_mixed_deployment_runs_through_the_placement_interface(tmp_path: Path) -> None:
    deployment = headless_deployment(tmp_path)
    local = FakePlacement()
    placement = PerStagePlacement(local, {1: HeadlessPlacement(deployment)})
    address = f"tcp://127.0.0.1:{deployment.head.port}"

    async def main() -> None:
        omni = AsyncOmni(deployment, placement=placement)
        context = zmq.asyncio.Context()
        try:
            await omni.start()
            (remote,) = omni.pools[1].clients
            assert isinstance(remote, RemoteStageClient) and list(local.clients) == [0]
            assert omni.placement.health() == {"headless": {"address": address, "accepting": True}}

            worker = HeadlessPeer(context, address)
            await worker.send(
                WorkerRegister(
                    stage_id=1,
                    worker_id="w1",
                    host="worker-host",
                    pid=4242,
                    config_digest=stage_config_digest(deployment, 1),
                )
            )
            assert isinstance(await worker.receive(), WorkerAccepted)

            async def serve_one() -> None:
                message = await worker.receive()
                assert isinstance(message, RemoteRequest)
                image = np.full((64, 64, 3), 9, dtype=np.uint8)
                output = StageDiffusionCoreOutput(
                    request_id=message.request.request_id, stage_id=1, image=image
                )
                await worker.send(RemoteOutput(request_id=output.request_id, output=output))

            served = asyncio.ensure_future(serve_one())
            result = await omni.generate(OmniRequest(prompt="abc", request_id="mixed"))
            await served
            assert result.ok, result.error
            assert np.asarray(result.output.image).shape == (64, 64, 3)
            assert local.clients[0][0].served == ["mixed"]  # the AR ran here, the DiT on the worker

            await omni.shutdown()
            assert isinstance(await worker.receive(), HeadShutdown)  # the placement told its worker
            assert omni.placement.health() == {"headless": {"address": address, "accepting": False}}
            assert local.clients[0][0].shutdowns == 1
            await omni.shutdown()  # a second stop does nothing more
        finally:
            await omni.shutdown()
            context.destroy(linger=0)

    asyncio.run(main())


def test_a_placement_that_cannot_start_stops_every_pool(tmp_path: Path) -> None:
    """A busy head port fails start-up with one line, and the stages already started are stopped."""
    with zmq.Context() as context, context.socket(zmq.ROUTER) as squatter:
        port = squatter.bind_to_random_port("tcp://127.0.0.1")
        deployment = headless_deployment(tmp_path, port)
        local = FakePlacement()
        omni = AsyncOmni(deployment, placement=PerStagePlacement(local, {1: HeadlessPlacement(deployment)}))
        with pytest.raises(StageStartError, match="set head.port in the deploy config to a free port"):
            asyncio.run(omni.start())
        assert local.clients[0][0].shutdowns == 1
        assert omni.placement.health()["headless"]["accepting"] is False
        squatter.close(linger=0)
