"""The layers of a deploy config merged per stage, lowest first: the file's common fields, its stages, its
``platforms:`` section for the current platform, vLLM flags of the command line (AR stages) and
``--stage-overrides``. Each layer records in the reporter where it set a field."""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.config.errors import ConfigError
from vllm_omni_plugin.config.merge import merge_stage, set_fields
from vllm_omni_plugin.config.pipeline import Pipeline
from vllm_omni_plugin.config.platform import PLATFORM_SECTIONS
from vllm_omni_plugin.config.report import Reporter
from vllm_omni_plugin.config.schema import DeployConfig, EngineCommon, StageDeployConfig, StageOverride

Stages = dict[int, StageDeployConfig]


def unknown_stage(pipeline: Pipeline, stage_id: int) -> str:
    stages = list(pipeline.stage_ids)
    return f"pipeline {pipeline.name!r} has no stage {stage_id} (stages: {stages})"


def layered_stages(
    cfg: DeployConfig,
    pipeline: Pipeline,
    platform_name: str,
    cli_engine_args: dict[str, Any],
    overrides: dict[int, StageOverride],
    report: Reporter,
) -> Stages:
    """Every stage of the pipeline with all layers merged, lowest first."""
    common = {k: v for k, v in set_fields(cfg).items() if k in EngineCommon.__struct_fields__}
    stages = {sid: StageDeployConfig(stage_id=sid, **common) for sid in pipeline.stage_ids}
    merge_file_stages(cfg, pipeline, stages, report)
    merge_platform_section(cfg, pipeline, platform_name, stages, report)
    merge_command_line(pipeline, cli_engine_args, stages, report)
    merge_overrides(pipeline, overrides, stages, report)
    return stages


def merge_file_stages(cfg: DeployConfig, pipeline: Pipeline, stages: Stages, report: Reporter) -> None:
    seen: set[int] = set()
    for stage in cfg.stages:
        if stage.stage_id not in stages:
            raise report.error(unknown_stage(pipeline, stage.stage_id), stage.stage_id, "stage_id")
        if stage.stage_id in seen:
            raise report.error(f"stage {stage.stage_id} is listed twice", stage.stage_id, "stage_id")
        seen.add(stage.stage_id)
        stages[stage.stage_id] = merge_stage(stages[stage.stage_id], stage)


def merge_platform_section(
    cfg: DeployConfig, pipeline: Pipeline, platform_name: str, stages: Stages, report: Reporter
) -> None:
    """Every section is checked; only the current platform's is merged."""
    for key, section in cfg.platforms.items():
        if key not in PLATFORM_SECTIONS:
            raise report.doc_error(
                f"unknown platform {key!r} (known: {', '.join(PLATFORM_SECTIONS)})", ("platforms", key)
            )
        for index, stage in enumerate(section.stages):
            if stage.stage_id not in stages:
                raise report.doc_error(
                    f"pipeline {pipeline.name!r} has no stage {stage.stage_id}",
                    ("platforms", key, "stages", index, "stage_id"),
                )
            if key == platform_name:
                for name in set_fields(stage):
                    report.set_at(stage.stage_id, name, f"{report.source} (platforms.{key})")
                stages[stage.stage_id] = merge_stage(stages[stage.stage_id], stage)


def merge_command_line(
    pipeline: Pipeline, cli_engine_args: dict[str, Any], stages: Stages, report: Reporter
) -> None:
    """vLLM flags given on the command line apply to the AR stages."""
    if not cli_engine_args:
        return
    fields = {k: v for k, v in cli_engine_args.items() if k in StageDeployConfig.__struct_fields__}
    extras = {k: v for k, v in cli_engine_args.items() if k not in fields}
    for s in pipeline.stages:
        if s.execution_type != "llm_ar":
            continue
        layer = StageDeployConfig(stage_id=s.stage_id, engine_extras=extras or None, **fields)
        for name in cli_engine_args:
            key = name if name in fields else f"engine_extras.{name}"
            report.set_at(s.stage_id, key, f"command line (--{name.replace('_', '-')})")
        stages[s.stage_id] = merge_stage(stages[s.stage_id], layer)


def merge_overrides(
    pipeline: Pipeline, overrides: dict[int, StageOverride], stages: Stages, report: Reporter
) -> None:
    for stage_id, override in overrides.items():
        if stage_id not in stages:
            raise ConfigError(
                unknown_stage(pipeline, stage_id), source="--stage-overrides", path=(str(stage_id),)
            )
        for name in set_fields(override):
            report.set_at(stage_id, name, "--stage-overrides")
        for key in override.engine_extras or {}:
            report.set_at(stage_id, f"engine_extras.{key}", "--stage-overrides")
        stages[stage_id] = merge_stage(stages[stage_id], override)
