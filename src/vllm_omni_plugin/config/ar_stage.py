"""An AR stage's vLLM engine arguments: the stage fields, ``engine_extras`` checked against vLLM's
EngineArgs, the Omni scheduler that follows the final ``async_scheduling`` flag and the platform's Omni
worker (pins of either are corrected or refused), what the pipeline reads from the model folder, and the
KV connector of a stage that exports contexts."""

from __future__ import annotations

import os
from typing import Any

from vllm_omni_plugin.config.edges import Wiring
from vllm_omni_plugin.config.model_runner import omni_kv_connector_config, uses_omni_kv_connector
from vllm_omni_plugin.config.pipeline import Pipeline, PipelineStage
from vllm_omni_plugin.config.platform import PlatformInfo, is_omni_worker
from vllm_omni_plugin.config.report import Reporter
from vllm_omni_plugin.config.schema import ENGINE_ARG_FIELDS, StageDeployConfig
from vllm_omni_plugin.config.vllm_fields import check_engine_value, engine_arg_types
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.schedulers import OMNI_AR_ASYNC_SCHEDULER, OMNI_AR_SCHEDULER, is_omni_ar_scheduler

RESERVED_ENGINE_EXTRAS = frozenset({"model", "tokenizer"})


def ar_engine_args(
    stage: StageDeployConfig,
    fixed: PipelineStage,
    pipeline: Pipeline,
    model: str,
    platform: PlatformInfo,
    wiring: Wiring,
    runner: str,
    report: Reporter,
) -> dict[str, Any]:
    extras = checked_engine_extras(stage, report)
    async_final = final_async_scheduling(stage, platform, report)
    scheduler = scheduler_cls(stage, extras.pop("scheduler_cls", None), async_final, report)
    worker = ar_worker(stage, extras.pop("worker_cls", None), platform, report)
    args: dict[str, Any] = {"model": os.path.join(model, fixed.model_subdir or "")}
    if fixed.tokenizer_subdir:
        args["tokenizer"] = os.path.join(model, fixed.tokenizer_subdir)
    for name in ENGINE_ARG_FIELDS:
        value = getattr(stage, name)
        if value is not None and name != "async_scheduling":
            args[name] = value
    args.update(async_scheduling=async_final, scheduler_cls=scheduler, worker_cls=worker)
    if stage.quantization is not None:
        if not isinstance(stage.quantization, str):
            raise report.error(
                "an AR stage's quantization is vLLM's method name (e.g. fp8, compressed-tensors), "
                "not a block",
                stage.stage_id,
                "quantization",
            )
        args["quantization"] = stage.quantization
    if fixed.engine_args_provider:
        try:
            provided = import_object(fixed.engine_args_provider)(args["model"])
        except (OSError, ValueError) as exc:  # the model folder is not what the pipeline reads
            raise report.error(
                f"pipeline {pipeline.name!r} cannot read its model {model!r}: {exc}", stage.stage_id
            ) from None
        args.update({k: v for k, v in provided.items() if k not in extras})
    args.update(extras)
    args.setdefault("enforce_eager", False)  # written out: whether vLLM captures CUDA graphs
    if uses_omni_kv_connector(fixed, runner):
        args["kv_transfer_config"] = omni_kv_connector_config(stage, fixed, args, wiring, report)
    return dict(sorted(args.items()))


def checked_engine_extras(stage: StageDeployConfig, report: Reporter) -> dict[str, Any]:
    """``engine_extras``, every key a vLLM EngineArgs field that no stage field or pipeline owns."""
    sid = stage.stage_id
    extras = dict(stage.engine_extras or {})
    known = engine_arg_types()
    for key, value in extras.items():
        field = f"engine_extras.{key}"
        if key in RESERVED_ENGINE_EXTRAS:
            raise report.error(f"{key} is set by the pipeline (model directory + subdir)", sid, field)
        if key in StageDeployConfig.__struct_fields__:
            raise report.error(f"{key} is a stage field; set `{key}:` on the stage instead", sid, field)
        if key not in known:
            raise report.error(f"{key!r} is not a vLLM EngineArgs field", sid, field)
        problem = check_engine_value(key, value)
        if problem:
            raise report.error(f"{problem}, got {value!r}", sid, field)
    return extras


def final_async_scheduling(stage: StageDeployConfig, platform: PlatformInfo, report: Reporter) -> bool:
    requested = stage.async_scheduling
    if platform.supports_async_scheduling:
        return True if requested is None else requested
    if requested:
        report.note_at(
            stage.stage_id,
            "async_scheduling",
            f"{platform.name} does not support async scheduling; using synchronous scheduling "
            "(OmniARScheduler)",
        )
    return False


def scheduler_cls(stage: StageDeployConfig, pinned: Any, async_final: bool, report: Reporter) -> str:
    """The Omni scheduler that matches ``async_final``; a pin of the other variant is corrected."""
    sid = stage.stage_id
    variant = OMNI_AR_ASYNC_SCHEDULER if async_final else OMNI_AR_SCHEDULER
    if pinned is None:
        return variant
    where = report.located(sid, "engine_extras.scheduler_cls")
    if not isinstance(pinned, str):
        raise report.error("scheduler_cls: expected a dotted class path", sid, "engine_extras.scheduler_cls")
    if is_omni_ar_scheduler(pinned):
        if pinned.replace(":", ".").rsplit(".", 1)[1] != variant.rsplit(".", 1)[1]:
            report.note(
                f"stage {sid} scheduler_cls pinned to {pinned}, which contradicts the final "
                f"async_scheduling={str(async_final).lower()}; using {variant} instead",
                at=where,
            )
        return variant
    if stage.allow_custom_scheduler:
        report.note(f"stage {sid} uses the custom scheduler {pinned}", at=where)
        return pinned
    raise report.error(
        f"scheduler_cls {pinned} is not an Omni AR scheduler; the AR stage runs "
        "OmniARScheduler or OmniARAsyncScheduler, chosen from async_scheduling. "
        "Remove it, or set allow_custom_scheduler: true to run your own",
        sid,
        "engine_extras.scheduler_cls",
    )


def ar_worker(stage: StageDeployConfig, pinned: Any, platform: PlatformInfo, report: Reporter) -> str:
    """The platform's Omni worker; a pin may only name the Omni worker family."""
    sid = stage.stage_id
    if pinned is not None and not (isinstance(pinned, str) and is_omni_worker(pinned)):
        raise report.error(
            f"worker_cls {pinned} is not an Omni worker; the AR stage needs the "
            "Omni worker for the platform (chosen by resolution). Remove it",
            sid,
            "engine_extras.worker_cls",
        )
    if platform.ar_worker_cls is None:
        raise report.error(f"the AR stage is not supported on platform {platform.name!r}", sid)
    return platform.ar_worker_cls
