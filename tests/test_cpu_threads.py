"""The CPU threads policy (``config/cpu_threads.py``): the split of the cores between the stages, what
resolution hands the AR stage's environment and the diffusion worker, and the worker applying it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_omni_plugin.config import PLATFORMS, packaged_deploy_config, resolve_deployment
from vllm_omni_plugin.config.cpu_threads import (
    THREADS_BIND_ENV,
    DiffusionThreads,
    StageThreads,
    ThreadPlan,
    cpu_list,
    split_cores,
    thread_plan,
    user_omp_threads,
)
from vllm_omni_plugin.config.loader import load_deploy_file
from vllm_omni_plugin.config.resolve import reresolve

CPU, GPU = PLATFORMS["cpu"], PLATFORMS["cuda"]
AR, DIT = StageThreads(stage_id=0, ar=True), StageThreads(stage_id=1, ar=False)
"""GLM-Image's and BAGEL's stages: one AR stage, one diffusion stage, a replica each."""
TINY_GLM = packaged_deploy_config("tiny_glm_image_cpu.yaml")


def cores(n: int) -> list[int]:
    return list(range(n))


# --- the split -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "ar_bind", "dit_cores"),
    [
        (1, "0", (0,)),  # one core: both share it
        (2, "0", (1,)),
        (3, "0", (1, 2)),
        (4, "0-1", (2, 3)),
        (16, "0-7", tuple(range(8, 16))),
    ],
)
def test_an_ar_stage_and_a_dit_split_the_cores(n: int, ar_bind: str, dit_cores: tuple[int, ...]) -> None:
    plan = split_cores(cores(n), [AR, DIT])
    assert plan.ar_env(0, 0) == {THREADS_BIND_ENV: ar_bind}
    assert plan.diffusion_args(1) == {"num_threads": len(dit_cores), "cpu_cores": list(dit_cores)}


@pytest.mark.parametrize("n", [1, 2, 4, 16])
def test_without_an_ar_stage_the_dit_takes_every_core(n: int) -> None:
    plan = split_cores(cores(n), [StageThreads(stage_id=0, ar=False)])
    assert plan.ar_binds == {}
    assert plan.diffusion_args(0) == {"num_threads": n, "cpu_cores": cores(n)}


@pytest.mark.parametrize(("n", "threads"), [(1, 1), (2, 1), (4, 2), (16, 5)])
def test_diffusion_replicas_share_their_cores(n: int, threads: int) -> None:
    plan = split_cores(cores(n), [StageThreads(stage_id=0, ar=False, replicas=3 if n == 16 else 2)])
    assert plan.diffusion[0] == DiffusionThreads(threads, tuple(cores(n)))


def test_the_ar_half_is_split_between_ar_replicas_and_stages() -> None:
    stages = [
        StageThreads(stage_id=0, ar=True, replicas=2),
        StageThreads(stage_id=1, ar=True),
        StageThreads(stage_id=2, ar=False),
    ]
    plan = split_cores(cores(16), stages)
    assert plan.ar_binds == {0: ("0-1", "2-4"), 1: ("5-7",)}
    assert plan.diffusion[2] == DiffusionThreads(8, tuple(range(8, 16)))
    # more AR replicas than AR cores: they share them, at least one core each
    plan = split_cores(cores(2), [StageThreads(stage_id=0, ar=True, replicas=3), DIT])
    assert plan.ar_binds == {0: ("0", "0", "0")}


def test_the_cores_are_this_process_s_whichever_ids_they_have() -> None:
    plan = split_cores([11, 3, 4, 5, 9, 10], [AR, DIT])
    assert plan.ar_env(0, 0) == {THREADS_BIND_ENV: "3-5"}
    assert plan.diffusion[1] == DiffusionThreads(3, (9, 10, 11))
    assert cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


@pytest.mark.parametrize("n", [1, 2, 4, 16])
def test_omp_num_threads_steps_the_policy_aside(n: int) -> None:
    assert split_cores(cores(n), [AR, DIT], omp_num_threads="1") == ThreadPlan()
    pinned = StageThreads(stage_id=1, ar=False, num_threads=3)
    assert split_cores(cores(n), [AR, pinned], omp_num_threads="1").diffusion_args(1) == {"num_threads": 3}


@pytest.mark.parametrize("n", [1, 2, 4, 16])
def test_a_user_bind_or_a_parallel_ar_stage_is_left_to_vllm(n: int) -> None:
    for ar in (
        StageThreads(stage_id=0, ar=True, user_bind=True),
        StageThreads(stage_id=0, ar=True, workers=2),
    ):
        plan = split_cores(cores(n), [ar, DIT])
        assert plan.ar_env(0, 0) == {}
        dit = cores(n)[max(1, n // 2) :] or [0]
        assert plan.diffusion_args(1) == {"num_threads": len(dit), "cpu_cores": dit}  # still off the AR's


@pytest.mark.parametrize("n", [1, 2, 4, 16])
def test_num_threads_pins_the_dit_without_binding(n: int) -> None:
    plan = split_cores(cores(n), [AR, StageThreads(stage_id=1, ar=False, num_threads=6)])
    assert plan.diffusion_args(1) == {"num_threads": 6}
    assert plan.ar_env(0, 0) == {THREADS_BIND_ENV: cpu_list(cores(max(1, n // 2)))}


def test_a_dit_in_the_api_server_process_is_not_bound() -> None:
    plan = split_cores(cores(4), [AR, StageThreads(stage_id=1, ar=False, process=False)])
    assert plan.diffusion_args(1) == {"num_threads": 2}
    assert plan.ar_env(0, 0) == {THREADS_BIND_ENV: "0-1"}


def test_an_ar_stage_alone_is_bound_by_vllm() -> None:
    assert split_cores(cores(4), [AR]) == ThreadPlan()


def test_the_policy_applies_on_cpu_with_every_stage_here() -> None:
    pinned = StageThreads(stage_id=1, ar=False, num_threads=2)
    local = thread_plan([AR, DIT], platform="cpu", backend="local", environ={}, cores=cores(4))
    assert local.ar_env(0, 0) == {THREADS_BIND_ENV: "0-1"}
    assert (
        thread_plan([AR, DIT], platform="cuda", backend="local", environ={}, cores=cores(4)) == ThreadPlan()
    )
    # Ray and headless stages: hosts resolution does not know, only a pinned num_threads is handed on
    assert thread_plan([AR, DIT], platform="cpu", backend="ray", environ={}, cores=cores(4)) == ThreadPlan()
    headless = StageThreads(stage_id=0, ar=True, headless=True)
    assert thread_plan([headless, DIT], platform="cpu", backend="local", environ={}) == ThreadPlan()
    ray = thread_plan([AR, pinned], platform="cpu", backend="ray", environ={}, cores=cores(4))
    assert ray == ThreadPlan(diffusion={1: DiffusionThreads(2)})
    # the user's OMP_NUM_THREADS; not the one vLLM sets for its own workers
    assert (
        thread_plan([AR, DIT], platform="cpu", backend="local", environ={"OMP_NUM_THREADS": "1"})
        == ThreadPlan()
    )
    assert user_omp_threads({"OMP_NUM_THREADS": "4", "VLLM_OMP_NUM_THREADS_SET_BY_VLLM": "1"}) is None


# --- resolution ------------------------------------------------------------------------------------


@pytest.fixture
def glm_dir(tmp_path: Path) -> str:
    """A directory that identifies itself as GLM-Image (resolution reads only model_index.json)."""
    (tmp_path / "model_index.json").write_text('{"_class_name": "GlmImagePipeline"}')
    return str(tmp_path)


def test_resolution_splits_this_machine_s_cores(glm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(THREADS_BIND_ENV, raising=False)
    mine = sorted(os.sched_getaffinity(0))
    half = max(1, len(mine) // 2)
    ar_cores, dit_cores = mine[:half], mine[half:] or mine[:1]
    resolved = resolve_deployment(glm_dir, deploy_config=str(TINY_GLM), platform=CPU)
    [replica] = resolved.stage(0).replicas
    assert replica.env[THREADS_BIND_ENV] == cpu_list(ar_cores)
    dit = resolved.stage(1).diffusion_args
    assert (dit["num_threads"], dit["cpu_cores"]) == (len(dit_cores), dit_cores)
    # --print-resolved-config shows both
    printed = yaml.safe_load(resolved.to_yaml())
    assert printed["stages"][0]["replicas"][0]["env"][THREADS_BIND_ENV] == cpu_list(ar_cores)
    assert printed["stages"][1]["diffusion_args"]["cpu_cores"] == dit_cores
    # not written into the completed config: resolving it again decides again, the same way
    assert resolved.deploy.stages[1].num_threads is None
    loaded = load_deploy_file(str(TINY_GLM), model=glm_dir, allow_legacy=False)
    assert reresolve(resolved, loaded, CPU).summary() == resolved.summary()


def test_resolution_leaves_the_user_s_choices(
    glm_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    resolved = resolve_deployment(glm_dir, deploy_config=str(TINY_GLM), platform=CPU)
    assert THREADS_BIND_ENV not in resolved.stage(0).replicas[0].env
    assert not {"num_threads", "cpu_cores"} & set(resolved.stage(1).diffusion_args)

    monkeypatch.delenv("OMP_NUM_THREADS")
    path = tmp_path / "deploy.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            base_config: tiny_glm_image_cpu.yaml
            stages:
              - stage_id: 0
                env: {{{THREADS_BIND_ENV}: "0"}}
              - stage_id: 1
                num_threads: 3
            """
        )
    )
    resolved = resolve_deployment(glm_dir, deploy_config=str(path), platform=CPU)
    assert resolved.stage(0).replicas[0].env[THREADS_BIND_ENV] == "0"
    assert resolved.stage(1).diffusion_args["num_threads"] == 3
    assert "cpu_cores" not in resolved.stage(1).diffusion_args

    ray = resolve_deployment(glm_dir, deploy_config=str(path), platform=CPU, backend="ray")
    assert ray.stage(1).diffusion_args["num_threads"] == 3
    gpu = resolve_deployment(glm_dir, deploy_config=str(path), platform=GPU)
    assert "num_threads" not in gpu.stage(1).diffusion_args
    assert any("num_threads" in note and "ignored on cuda" in note for note in gpu.notes)


def test_num_threads_does_not_apply_to_an_ar_stage(glm_dir: str, tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("base_config: tiny_glm_image_cpu.yaml\nstages:\n  - stage_id: 0\n    num_threads: 2\n")
    resolved = resolve_deployment(glm_dir, deploy_config=str(path), platform=CPU)
    assert any("num_threads" in note and "does not apply" in note for note in resolved.notes)


# --- the worker ------------------------------------------------------------------------------------

WORKER = """
import json, os, sys
import torch
from vllm_omni_plugin.diffusion.worker import CPUDiffusionWorker
worker = CPUDiffusionWorker(**json.loads(sys.argv[1]))
worker.init_device()
print(json.dumps({"threads": torch.get_num_threads(), "cores": sorted(os.sched_getaffinity(0))}))
"""
STAGE = """
import json, os, sys
import torch
from vllm_omni_plugin.stage.diffusion_core_proc import load_diffusion_engine
engine, device = load_diffusion_engine(json.loads(sys.argv[1]))
print(json.dumps({"threads": torch.get_num_threads(), "cores": sorted(os.sched_getaffinity(0)), "device": device}))
"""


def in_child(script: str, args: dict[str, Any]) -> dict[str, Any]:
    """What ``script`` prints last, run on ``args`` in a child without ``OMP_NUM_THREADS`` (this process
    keeps its affinity and threads)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(args)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.processes
def test_the_diffusion_worker_binds_itself_to_its_cores() -> None:
    mine = sorted(os.sched_getaffinity(0))
    assert in_child(WORKER, {"cpu_cores": [mine[-1]]}) == {"threads": 1, "cores": [mine[-1]]}
    two = mine[:2]
    assert in_child(WORKER, {"num_threads": len(two), "cpu_cores": two}) == {
        "threads": len(two),
        "cores": two,
    }
    # num_threads alone pins the threads and binds nothing
    assert in_child(WORKER, {"num_threads": 3}) == {"threads": 3, "cores": mine}


@pytest.mark.processes
def test_a_stage_process_loads_its_engine_on_the_resolved_cores(
    tiny_glm_image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resolved diffusion_args as a stage process gets them: the worker takes the threads and cores,
    the engine the rest."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(THREADS_BIND_ENV, raising=False)
    resolved = resolve_deployment(str(tiny_glm_image), deploy_config=str(TINY_GLM), platform=CPU)
    args = resolved.stage(1).diffusion_args
    seen = in_child(STAGE, args)
    assert seen == {"threads": args["num_threads"], "cores": args["cpu_cores"], "device": "cpu"}
