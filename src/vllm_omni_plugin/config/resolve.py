"""Resolution: one function that turns every configuration layer into per-stage, per-replica arguments.

Layers, lowest first: ``base_config`` parents, the file, its ``platforms:`` section for the current
platform, vLLM flags given on the command line (AR stages) and ``--stage-overrides``. Only after all of
them does resolution derive what must never be hand-declared: the AR scheduler class follows the final
``async_scheduling`` flag (which the platform may force off), the workers follow the platform, every
edge gets its connector and every connector's ``extra`` is checked. What comes out
(:mod:`vllm_omni_plugin.config.resolved`) is complete: nothing downstream applies defaults again.

This module assembles; each concept lives in a module of its own, and all of them report through one
:class:`~vllm_omni_plugin.config.report.Reporter`: ``layers`` (merging), ``edges`` (connectors and
edges), ``ar_stage`` (engine arguments, scheduler, worker), ``model_runner`` (V1/V2 and the context
export KV connector), ``diffusion_stage`` (worker arguments and defaults), ``stage_fields`` (checks every
stage goes through) and ``placement`` (devices, Ray, shared-device budgets).
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_omni_plugin.config.ar_stage import ar_engine_args
from vllm_omni_plugin.config.cpu_threads import ThreadPlan, diffusion_thread_args, stage_threads, thread_plan
from vllm_omni_plugin.config.diffusion_stage import diffusion_args, request_defaults
from vllm_omni_plugin.config.edges import StageIO, Wiring, check_headless_connectors, wire
from vllm_omni_plugin.config.errors import ConfigError
from vllm_omni_plugin.config.layers import layered_stages
from vllm_omni_plugin.config.loader import LoadedConfig
from vllm_omni_plugin.config.merge import set_fields
from vllm_omni_plugin.config.model_runner import context_export_cpu_env, model_runner
from vllm_omni_plugin.config.pipeline import Pipeline, PipelineStage
from vllm_omni_plugin.config.platform import PlatformInfo, current_platform
from vllm_omni_plugin.config.replicas import (
    check_shared_devices,
    diffusion_devices,
    ray_resources,
    ray_settings,
    replicas,
)
from vllm_omni_plugin.config.report import Reporter
from vllm_omni_plugin.config.resolved import ResolvedDeployment, ResolvedHead, ResolvedStage
from vllm_omni_plugin.config.schema import Backend, DeployConfig, HeadSpec, StageDeployConfig, StageOverride
from vllm_omni_plugin.config.stage_fields import check_not_applicable, process_mode, sampling_params
from vllm_omni_plugin.dotted import import_object

DEFAULT_COMPANION_TIMEOUT_S = 30.0
DEFAULT_MAX_RETRIES = 1


def resolve(
    loaded: LoadedConfig,
    *,
    model: str,
    platform: PlatformInfo | None = None,
    cli_engine_args: dict[str, Any] | None = None,
    stage_overrides: dict[int, StageOverride] | None = None,
    backend: Backend | None = None,
) -> ResolvedDeployment:
    """Resolve a loaded deploy config for ``model`` on ``platform`` (default: the current one);
    ``backend`` (``--worker-backend``) wins over the file's."""
    platform = platform or current_platform()
    pipeline, cfg = loaded.pipeline, loaded.config
    chosen_backend: Backend = backend or cfg.backend or "local"
    report = Reporter(loaded)
    if cfg.async_chunk and pipeline.streaming_processor is None:
        raise report.doc_error(
            f"async_chunk: true needs a streaming stage-input processor, and pipeline "
            f"{pipeline.name!r} has none; set async_chunk: false",
            ("async_chunk",),
        )
    stages = layered_stages(
        cfg, pipeline, platform.name, dict(cli_engine_args or {}), dict(stage_overrides or {}), report
    )
    wiring = wire(cfg, pipeline, chosen_backend, stages, report)
    threads = thread_plan(
        [stage_threads(stages[f.stage_id], f) for f in pipeline.stages],
        platform=platform.name,
        backend=chosen_backend,
    )
    resolved = [
        resolve_stage(
            stages[f.stage_id],
            f,
            wiring.ios[f.stage_id],
            wiring=wiring,
            pipeline=pipeline,
            model=model,
            platform=platform,
            backend=chosen_backend,
            threads=threads,
            report=report,
        )
        for f in pipeline.stages
    ]
    check_shared_devices(resolved, platform, chosen_backend, report)
    max_retries = DEFAULT_MAX_RETRIES if cfg.max_retries is None else cfg.max_retries
    deploy = DeployConfig(
        pipeline=pipeline.name,
        async_chunk=bool(cfg.async_chunk),
        backend=chosen_backend,
        ray=cfg.ray,
        max_retries=max_retries,
        connectors=wiring.connectors,
        head=cfg.head,
        edges=list(cfg.edges),
        stages=[completed_stage(stages[r.stage_id], r) for r in resolved],
    )
    check_model(pipeline, model, report)
    return ResolvedDeployment(
        pipeline=pipeline.name,
        model=model,
        platform=platform.name,
        async_chunk=bool(cfg.async_chunk),
        connectors=dict(sorted(wiring.connectors.items())),
        edges=wiring.edges,
        stages=resolved,
        deploy=deploy,
        head=head(cfg, report),
        backend=chosen_backend,
        ray=ray_settings(cfg, chosen_backend, report),
        max_retries=max_retries,
        notes=report.notes,
        legacy_source=loaded.source if loaded.legacy else None,
    )


def reresolve(
    resolved: ResolvedDeployment, loaded: LoadedConfig, platform: PlatformInfo
) -> ResolvedDeployment:
    """Resolve a resolution's completed config again (used to check idempotence)."""
    again = LoadedConfig(
        config=resolved.deploy, source=loaded.source, pipeline=loaded.pipeline, lines=loaded.lines
    )
    return resolve(again, model=resolved.model, platform=platform)


def resolve_stage(
    stage: StageDeployConfig,
    fixed: PipelineStage,
    io: StageIO,
    *,
    wiring: Wiring,
    pipeline: Pipeline,
    model: str,
    platform: PlatformInfo,
    backend: Backend,
    threads: ThreadPlan,
    report: Reporter,
) -> ResolvedStage:
    check_not_applicable(stage, fixed, report)
    is_ar = fixed.execution_type == "llm_ar"
    process, headless = process_mode(stage, fixed, backend, report)
    if headless:
        check_headless_connectors(fixed.stage_id, wiring.connectors, io, report)
    runner = why = None
    runner_env: dict[str, str] = {}
    engine_args: dict[str, Any] = {}
    if is_ar:
        runner, why, runner_env = model_runner(stage, platform, report)
        runner_env.update(context_export_cpu_env(stage, fixed, runner, platform))
        engine_args = ar_engine_args(stage, fixed, pipeline, model, platform, wiring, runner, report)
    # Devices per replica: an AR stage's tensor parallel group, a diffusion stage's CFG- or
    # sequence-parallel one.
    if is_ar:
        width, field = engine_args.get("tensor_parallel_size", 1), "tensor_parallel_size"
    else:
        width, field = diffusion_devices(stage)
    stage_replicas = replicas(stage, width, runner_env, platform, backend, report, field)
    if is_ar:  # the CPU threads policy's cores for each replica's worker (config/cpu_threads.py)
        stage_replicas = [
            msgspec.structs.replace(r, env={**threads.ar_env(fixed.stage_id, r.replica_id), **r.env})
            for r in stage_replicas
        ]
    resources = ray_resources(stage, engine_args if is_ar else {}, platform, backend, report)
    sampling = sampling_params(stage, fixed, pipeline, report)
    dit_args: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    if not is_ar:
        defaults = request_defaults(stage, sampling, pipeline)
        dit_args = diffusion_args(stage, sampling, pipeline, model, platform, report)
        dit_args.update(diffusion_thread_args(stage, threads, platform, report))
        dit_args = dict(sorted(dit_args.items()))
    return ResolvedStage(
        stage_id=fixed.stage_id,
        name=fixed.name,
        execution_type=fixed.execution_type,
        process=process,
        num_replicas=len(stage_replicas),
        replicas=stage_replicas,
        input_sources=list(fixed.input_sources),
        input_processor=fixed.input_processor,
        final_output=fixed.final_output,
        output_type=fixed.output_type,
        input_connectors=dict(sorted(io["input"].items())),
        output_connectors=dict(sorted(io["output"].items())),
        default_sampling_params=sampling,
        engine_args=engine_args,
        diffusion_args=dit_args,
        request_defaults=defaults,
        headless=headless,
        continuation=fixed.continuation,
        companion_timeout_s=stage.companion_timeout_s or DEFAULT_COMPANION_TIMEOUT_S,
        ray_resources=resources,
        model_runner=runner,
        model_runner_reason=why,
    )


def completed_stage(stage: StageDeployConfig, resolved: ResolvedStage) -> StageDeployConfig:
    """The stage as a deploy config that resolves to ``resolved`` again (derived values written out,
    corrected pins dropped)."""
    done = msgspec.structs.replace(
        stage,
        num_replicas=resolved.num_replicas,
        process=resolved.process,
        input_connectors=resolved.input_connectors or None,
        output_connectors=resolved.output_connectors or None,
    )
    if resolved.execution_type != "llm_ar":
        return done
    extras = {
        k: v
        for k, v in (stage.engine_extras or {}).items()
        if k not in ("scheduler_cls", "worker_cls") or stage.allow_custom_scheduler
    }
    return msgspec.structs.replace(
        done, async_scheduling=resolved.engine_args["async_scheduling"], engine_extras=extras or None
    )


def check_model(pipeline: Pipeline, model: str, report: Reporter) -> None:
    """A pipeline that serves what the model folder says (``model_inspector``) refuses a model it
    cannot drive now, in one line, rather than in a stage process that fails to load."""
    if pipeline.model_inspector is None:
        return
    try:
        import_object(pipeline.model_inspector)(model)
    except (ValueError, OSError) as exc:
        raise ConfigError(
            f"pipeline {pipeline.name!r} cannot serve {model}: {exc}", source=report.source
        ) from None


def head(cfg: DeployConfig, report: Reporter) -> ResolvedHead:
    resolved = ResolvedHead(**set_fields(cfg.head or HeadSpec()))
    if resolved.heartbeat_timeout_s <= resolved.heartbeat_interval_s:
        raise report.doc_error(
            f"heartbeat_timeout_s ({resolved.heartbeat_timeout_s}) must be longer than "
            f"heartbeat_interval_s ({resolved.heartbeat_interval_s})",
            ("head", "heartbeat_timeout_s"),
        )
    return resolved
