"""Backend ray without a cluster: which connector objects a Ray-hosted replica uses on the head, from the
node its actor landed on (the actor picks the same names from the same edges), and the shared memory
that cannot cross nodes. Real connector objects (a NIXL agent, a shared-memory pool); Ray itself is not
imported on this path."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_omni_plugin.config import PLATFORMS, ResolvedDeployment, resolve_deployment
from vllm_omni_plugin.connectors.base import OmniConnector
from vllm_omni_plugin.stage.errors import StageStartError
from vllm_omni_plugin.stage.factory import build_connectors
from vllm_omni_plugin.stage.placement.ray.actor import ActorPlaced
from vllm_omni_plugin.stage.placement.ray.head import RayPlacement, RayStageClient
from vllm_omni_testkit.harness.forks import VllmForks

HEAD_NODE, OTHER_NODE = "a" * 56, "b" * 56


def deployment(tmp_path: Path, text: str) -> ResolvedDeployment:
    model = tmp_path / "glm-image"
    model.mkdir(exist_ok=True)
    (model / "model_index.json").write_text('{"_class_name": "GlmImagePipeline"}')
    path = tmp_path / "deploy.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return resolve_deployment(str(model), deploy_config=str(path), platform=PLATFORMS["cpu"])


@pytest.fixture
def connectors(tmp_path: Path) -> Iterator[tuple[ResolvedDeployment, dict[str, OmniConnector]]]:
    resolved = deployment(
        tmp_path,
        """
        pipeline: glm_image
        backend: ray
        connectors:
          nixl: {name: NixlConnector}
          shm: {name: SharedMemoryConnector}
        edges:
          - {from: 0, to: 1, same_node_connector: shm}
          - {from: 1, to: router, same_node_connector: shm}
        stages:
          - {stage_id: 0, output_connectors: {to_stage_1: nixl}}
          - {stage_id: 1, output_connectors: {to_stage_router: nixl}}
        """,
    )
    made = build_connectors(resolved)
    yield resolved, made
    for connector in made.values():
        connector.close()


def dit_client(resolved: ResolvedDeployment, made: dict[str, OmniConnector]) -> RayStageClient:
    owner = RayPlacement(resolved)
    owner.head_node_id = HEAD_NODE  # what connect() reads from Ray
    return RayStageClient(owner, resolved.stage(1), 0, made)


def placed(node_id: str) -> ActorPlaced:
    return ActorPlaced(node_id=node_id, node_ip="10.0.0.2", host="dit-host", pid=4242)


def test_a_replica_on_the_head_node_uses_the_same_node_connector(connectors) -> None:
    resolved, made = connectors
    client = dit_client(resolved, made)
    client._pick_connectors(placed(HEAD_NODE))
    assert (client.input_connector, client.output_connector) == (made["shm"], made["shm"])


def test_a_replica_on_another_node_uses_the_edge_connector(connectors) -> None:
    resolved, made = connectors
    client = dit_client(resolved, made)
    client._pick_connectors(placed(OTHER_NODE))
    assert (client.input_connector, client.output_connector) == (made["nixl"], made["nixl"])
    assert client.actor_name.endswith("-stage1-dit-replica0")


def test_shared_memory_cannot_reach_another_node(tmp_path: Path) -> None:
    resolved = deployment(tmp_path, "pipeline: glm_image\nbackend: ray\n")
    made = build_connectors(resolved)
    try:
        client = dit_client(resolved, made)
        client._pick_connectors(placed(HEAD_NODE))  # one node: fine
        with pytest.raises(StageStartError) as info:
            client._pick_connectors(placed(OTHER_NODE))
        assert "reaches processes on one node only; use NixlConnector with same_node_connector" in str(
            info.value
        )
    finally:
        for connector in made.values():
            connector.close()


@pytest.mark.processes
def test_no_cluster_at_the_address_is_one_line_and_exit_2(tmp_path: Path, vllm_cli: VllmForks) -> None:
    """Ray itself would retry an address where nothing answers for minutes; the server says so at once."""
    from vllm_omni_testkit.harness.server import cpu_test_env, free_port

    resolved = deployment(tmp_path, "pipeline: glm_image\nbackend: ray\n")
    argv = ["serve", resolved.model, "--omni", "--deploy-config", str(tmp_path / "deploy.yaml"),
            "--port", str(free_port())]  # fmt: skip
    env = cpu_test_env({"RAY_ADDRESS": f"127.0.0.1:{free_port()}"})
    result = vllm_cli.run(*argv, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("error: backend ray: cannot join a Ray cluster (nothing answers at 127.0.0.1:"), (
        last
    )
    assert "Traceback" not in result.stderr
