"""Deploy configuration of backend ray: placements, the ray section, per-edge same-node connectors, what
cannot run as a Ray actor, and the command line's --worker-backend. No Ray cluster needed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from vllm_omni_plugin.config import (
    PLATFORMS,
    ConfigError,
    load_deploy_file,
    packaged_deploy_configs,
    resolve_deployment,
)
from vllm_omni_plugin.config.resolve import reresolve
from vllm_omni_plugin.config.resolved import RayResources, ResolvedRay

GPU, CPU = PLATFORMS["cuda"], PLATFORMS["cpu"]
RAY_DEPLOY = next(p for p in packaged_deploy_configs() if p.name == "glm_image_ray.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("glm-image")
    (path / "model_index.json").write_text('{"_class_name": "GlmImagePipeline"}')
    return str(path)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def test_packaged_ray_config_places_each_stage_by_its_resources(model_dir: str) -> None:
    resolved = resolve_deployment(model_dir, deploy_config=str(RAY_DEPLOY), platform=GPU)
    assert resolved.backend == "ray"
    assert resolved.ray == ResolvedRay(namespace="vllm_omni", placement_timeout_s=300.0)
    ar, dit = resolved.stage(0).ray_resources, resolved.stage(1).ray_resources
    assert ar == RayResources(num_cpus=1.0, num_gpus=1.0, resources={"ar_host": 1.0})
    assert dit == RayResources(num_cpus=1.0, num_gpus=1.0, resources={"dit_host": 1.0})
    assert resolved.stage(1).num_replicas == 2
    # NIXL between hosts, shared memory where both ends of a hand-over share a node
    for edge in resolved.edges:
        assert (edge.connector_between(False), edge.connector_between(True)) == ("nixl", "shm")
    assert not resolved.notes


def test_defaults_follow_the_platform_and_the_stage_devices(tmp_path: Path, model_dir: str) -> None:
    path = write(
        tmp_path,
        """
        pipeline: glm_image
        backend: ray
        stages:
          - {stage_id: 0, tensor_parallel_size: 2, devices: "0,1"}
        """,
    )
    gpu = resolve_deployment(model_dir, deploy_config=str(path), platform=GPU)
    assert gpu.ray == ResolvedRay()
    assert [s.ray_resources.num_gpus for s in gpu.stages] == [2.0, 1.0]
    assert gpu.stage(0).ray_resources.placement_group and not gpu.stage(1).ray_resources.placement_group
    assert all(s.ray_resources.num_cpus == 1.0 and s.ray_resources.max_restarts == -1 for s in gpu.stages)
    # Ray gives each replica its devices: no device ids of ours in its environment
    assert "CUDA_VISIBLE_DEVICES" not in gpu.stage(0).replicas[0].env
    assert gpu.stage(0).replicas[0].devices is None
    assert any("devices: ignored with backend ray" in n for n in gpu.notes)
    cpu = resolve_deployment(model_dir, deploy_config=str(path), platform=CPU)
    assert [s.ray_resources.num_gpus for s in cpu.stages] == [0.0, 0.0]


def test_worker_backend_flag_wins_over_the_file(tmp_path: Path, model_dir: str) -> None:
    local = resolve_deployment(model_dir, deploy_config=str(RAY_DEPLOY), platform=GPU, backend="local")
    assert local.backend == "local" and local.ray is None
    assert all(s.ray_resources is None for s in local.stages)
    assert all(e.same_node_connector is None for e in local.edges)
    assert any("stage 1 resources: applies to backend ray only; ignored" in n for n in local.notes)
    assert any("same_node_connector applies to backend ray only" in n for n in local.notes)
    plain = write(tmp_path, "pipeline: glm_image\n")
    ray = resolve_deployment(model_dir, deploy_config=str(plain), platform=CPU, backend="ray")
    assert ray.backend == "ray" and ray.stage(1).ray_resources == RayResources(num_cpus=1.0, num_gpus=0.0)


@pytest.mark.parametrize("platform", [GPU, CPU], ids=["cuda", "cpu"])
def test_ray_resolution_is_idempotent_with_the_flag(platform, model_dir: str, tmp_path: Path) -> None:
    path = write(tmp_path, "pipeline: glm_image\nstages: [{stage_id: 1, num_replicas: 2, num_gpus: 0.5}]\n")
    loaded = load_deploy_file(path, model=model_dir, allow_legacy=False)
    first = resolve_deployment(model_dir, deploy_config=str(path), platform=platform, backend="ray")
    again = reresolve(first, loaded, platform)  # the completed config carries the flag's backend
    assert again.summary() == first.summary()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            """
            pipeline: glm_image
            backend: kubernetes
            """,
            "backend",
        ),
        (
            """
            pipeline: glm_image
            backend: ray
            stages: [{stage_id: 1, headless: true}]
            """,
            "stages[stage_id=1].headless: backend ray places every stage on the Ray cluster",
        ),
        (
            """
            pipeline: glm_image
            backend: ray
            stages: [{stage_id: 1, process: false}]
            """,
            "stages[stage_id=1].process: backend ray runs every stage replica as a Ray actor",
        ),
        (
            """
            pipeline: glm_image
            backend: ray
            connectors: {local: {name: InProcessConnector}}
            stages: [{stage_id: 0, output_connectors: {to_stage_1: local}}]
            """,
            "edge 0 -> 1 uses an InProcessConnector, which cannot reach a Ray actor's process",
        ),
        (
            """
            pipeline: glm_image
            backend: ray
            edges: [{from: 0, to: 1, same_node_connector: shm}]
            """,
            "edges[0].same_node_connector: connector 'shm' is not defined under connectors:",
        ),
        (
            """
            pipeline: glm_image
            edges: [{from: 0, to: router}]
            """,
            "edges[0].from: only the final stage (1) sends its output to the router",
        ),
        (
            """
            pipeline: glm_image
            edges: [{from: 1, to: router, max_inflight: 2}]
            """,
            "edges[0].max_inflight: max_inflight limits requests into a stage",
        ),
        (
            """
            pipeline: glm_image
            backend: ray
            stages: [{stage_id: 1, resources: {dit_host: 0}}]
            """,
            "stages[0].resources.dit_host: expected float > 0.0",
        ),
        (
            """
            pipeline: glm_image
            backend: ray
            stages: [{stage_id: 1, max_restarts: -2}]
            """,
            "stages[0].max_restarts",
        ),
        (
            """
            pipeline: glm_image
            ray: {placement_timeout_s: 0}
            """,
            "ray.placement_timeout_s",
        ),
    ],
)
def test_what_cannot_run_on_ray_is_one_config_error(tmp_path: Path, model_dir: str, text: str, message: str):
    with pytest.raises(ConfigError) as info:
        resolve_deployment(model_dir, deploy_config=str(write(tmp_path, text)), platform=CPU)
    assert message in str(info.value)
    assert "deploy.yaml" in str(info.value)


def test_shared_memory_across_ray_nodes_gets_a_note(tmp_path: Path, model_dir: str) -> None:
    path = write(tmp_path, "pipeline: glm_image\nbackend: ray\n")
    resolved = resolve_deployment(model_dir, deploy_config=str(path), platform=CPU)
    notes = [n for n in resolved.notes if "SharedMemoryConnector" in n]
    assert len(notes) == 2 and all("fails to start" in n for n in notes)


def test_worker_backend_flag_on_the_command_line(model_dir: str) -> None:
    from vllm_omni_plugin.entrypoints.cli import parse_args, resolve_from_args

    args = parse_args(
        ["serve", model_dir, "--omni", "--deploy-config", str(RAY_DEPLOY), "--worker-backend", "local"]
    )
    assert args.worker_backend == "local"
    assert resolve_from_args(args).backend == "local"
    args = parse_args(["serve", model_dir, "--omni", "--deploy-config", str(RAY_DEPLOY)])
    assert args.worker_backend is None and resolve_from_args(args).backend == "ray"
