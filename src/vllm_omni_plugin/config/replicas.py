"""A stage's replicas: their devices on this host, what each asks a Ray cluster for (backend ray), and
the memory budgets of stages that share a device. (Where replicas run, a stage's *placement*, is
``stage/placement/``'s.)"""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.config.merge import set_fields
from vllm_omni_plugin.config.platform import PlatformInfo
from vllm_omni_plugin.config.report import Reporter
from vllm_omni_plugin.config.resolved import RayResources, ResolvedRay, ResolvedReplica, ResolvedStage
from vllm_omni_plugin.config.schema import (
    RAY_RESOURCE_FIELDS,
    Backend,
    DeployConfig,
    RaySpec,
    StageDeployConfig,
)

VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""What a vLLM engine takes of its device when ``gpu_memory_utilization`` is not set."""


def diffusion_devices(stage: StageDeployConfig) -> tuple[int, str]:
    """The devices (processes) a diffusion replica spans, and the field that sets them."""
    if (stage.sequence_parallel_size or 1) > 1:
        return stage.sequence_parallel_size or 1, "sequence_parallel_size"
    return stage.cfg_parallel_size or 1, "cfg_parallel_size"


def replicas(
    stage: StageDeployConfig,
    tp: int,
    extra_env: dict[str, str] | None,
    platform: PlatformInfo,
    backend: Backend,
    report: Reporter,
    width_field: str = "tensor_parallel_size",
) -> list[ResolvedReplica]:
    """The stage's replicas, each with its devices (one set per replica, or one set shared by all);
    ``tp`` devices each (the stage's ``width_field``)."""
    n = stage.num_replicas or 1
    env = {**(extra_env or {}), **(stage.env or {})}
    devices = [d.strip() for d in (stage.devices or "").split(",") if d.strip()]
    device_env = platform.device_env
    if devices and backend == "ray":
        report.note_at(
            stage.stage_id,
            "devices",
            "ignored with backend ray: Ray gives each replica its devices (num_gpus)",
        )
        devices = []
    if devices and device_env is None:
        report.note_at(stage.stage_id, "devices", f"ignored on {platform.name}")
        devices = []
    if not devices or device_env is None:
        return [ResolvedReplica(replica_id=i, env=env) for i in range(n)]
    if len(devices) == n * tp:
        chunks = [devices[i * tp : (i + 1) * tp] for i in range(n)]
    elif len(devices) == tp:
        chunks = [devices] * n
    else:
        raise report.error(
            f"{len(devices)} device(s) {','.join(devices)} cannot hold {n} replica(s) of "
            f"{width_field} {tp}: give {n * tp} device ids (one set per replica) or {tp} "
            "(shared by all replicas)",
            stage.stage_id,
            "devices",
        )
    return [
        ResolvedReplica(replica_id=i, devices=",".join(chunk), env={**env, device_env: ",".join(chunk)})
        for i, chunk in enumerate(chunks)
    ]


def ray_resources(
    stage: StageDeployConfig,
    engine_args: dict[str, Any],
    platform: PlatformInfo,
    backend: Backend,
    report: Reporter,
) -> RayResources | None:
    """What each replica asks the Ray cluster for (backend ray); on the local backend the fields are
    noted as having no effect."""
    if backend != "ray":
        for name in RAY_RESOURCE_FIELDS:
            if getattr(stage, name) is not None:
                report.note_at(stage.stage_id, name, "applies to backend ray only; ignored")
        return None
    devices = 0.0
    if platform.device_env is not None:  # a GPU platform: each replica's devices
        devices = float(
            engine_args.get("tensor_parallel_size", 1) * engine_args.get("pipeline_parallel_size", 1)
            if engine_args
            else diffusion_devices(stage)[0]
        )
    if stage.num_gpus is not None and stage.num_gpus > 1 and not float(stage.num_gpus).is_integer():
        raise report.error(
            f"{stage.num_gpus:g} GPUs: Ray gives a replica a fraction of one GPU or whole GPUs",
            stage.stage_id,
            "num_gpus",
        )
    return RayResources(
        num_cpus=1.0 if stage.num_cpus is None else stage.num_cpus,
        num_gpus=devices if stage.num_gpus is None else stage.num_gpus,
        resources=dict(sorted((stage.resources or {}).items())),
        node_labels=dict(sorted((stage.node_labels or {}).items())),
        max_restarts=-1 if stage.max_restarts is None else stage.max_restarts,
    )


def ray_settings(cfg: DeployConfig, backend: Backend, report: Reporter) -> ResolvedRay | None:
    if backend != "ray":
        if cfg.ray is not None:
            report.note("ray: applies to backend ray only; ignored")
        return None
    return ResolvedRay(**set_fields(cfg.ray or RaySpec()))


def check_shared_devices(
    resolved: list[ResolvedStage], platform: PlatformInfo, backend: Backend, report: Reporter
) -> None:
    """Stages placed on one device of this host split its memory: their ``gpu_memory_utilization``
    (an AR stage without one takes vLLM's default, 0.9) must add up to at most 1, or the second
    stage to start finds the device full."""
    if platform.device_env is None or backend != "local":
        return
    shares: dict[str, list[tuple[ResolvedStage, float, str]]] = {}
    for stage in resolved:
        if stage.headless:  # its devices are another host's
            continue
        if stage.execution_type == "llm_ar":
            share = stage.engine_args.get("gpu_memory_utilization")
            note = "" if share is not None else " (vLLM's default)"
            share = VLLM_DEFAULT_GPU_MEMORY_UTILIZATION if share is None else share
        else:
            share, note = stage.diffusion_args.get("gpu_memory_utilization"), ""
            if share is None:
                continue
        for device in stage.devices():
            shares.setdefault(device, []).append((stage, float(share), note))
    for device, users in sorted(shares.items()):
        total = sum(share for _, share, _ in users)
        if len(users) > 1 and total > 1.0 + 1e-9:
            parts = ", ".join(f"stage {s.stage_id} ({s.name}) {share:g}{note}" for s, share, note in users)
            raise report.error(
                f"device {device} is shared by {parts}: together {total:g} of its memory; lower their "
                "gpu_memory_utilization so that they add up to at most 1 (about 0.9 leaves room for "
                "each process's CUDA context)",
                users[-1][0].stage_id,
                "gpu_memory_utilization",
            )
