"""Configuration: pipelines (frozen topology), deploy configs (stages form), legacy stage_args
translation, and the one resolution every entry point goes through."""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.config.errors import ConfigError
from vllm_omni_plugin.config.loader import (
    LoadedConfig,
    load_deploy_file,
    packaged_deploy_config,
    packaged_deploy_configs,
    parse_stage_overrides,
)
from vllm_omni_plugin.config.pipeline import (
    DiffusionDefaults,
    Pipeline,
    PipelineStage,
    detect_pipeline,
    get_pipeline,
    register_pipeline,
)
from vllm_omni_plugin.config.platform import PLATFORMS, PlatformInfo, current_platform
from vllm_omni_plugin.config.resolve import resolve
from vllm_omni_plugin.config.resolved import ResolvedDeployment, ResolvedStage
from vllm_omni_plugin.config.schema import Backend

__all__ = [
    "PLATFORMS",
    "ConfigError",
    "DiffusionDefaults",
    "LoadedConfig",
    "Pipeline",
    "PipelineStage",
    "PlatformInfo",
    "ResolvedDeployment",
    "ResolvedStage",
    "current_platform",
    "detect_pipeline",
    "get_pipeline",
    "load_config",
    "load_deploy_file",
    "packaged_deploy_config",
    "packaged_deploy_configs",
    "parse_stage_overrides",
    "register_pipeline",
    "resolve",
    "resolve_deployment",
]


def load_config(
    model: str, *, deploy_config: str | None = None, stage_configs_path: str | None = None
) -> LoadedConfig:
    """The entry points' choice of document: --deploy-config, --stage-configs-path or the packaged one."""
    if deploy_config and stage_configs_path:
        raise ConfigError("--deploy-config and --stage-configs-path both name a config; give only one")
    if deploy_config:
        return load_deploy_file(deploy_config, model=model, allow_legacy=False)
    if stage_configs_path:
        return load_deploy_file(stage_configs_path, model=model, allow_legacy=True)
    pipeline = detect_pipeline(model)
    if pipeline is None:
        raise ConfigError(
            f"cannot tell which pipeline model {model!r} is (no model_index.json or config.json that "
            "a registered pipeline recognises); pass --deploy-config with a `pipeline:` field"
        )
    if pipeline.default_deploy_config is None:
        raise ConfigError(f"pipeline {pipeline.name!r} has no packaged deploy config; pass --deploy-config")
    return load_deploy_file(
        packaged_deploy_config(pipeline.default_deploy_config), model=model, allow_legacy=False, packaged=True
    )


def resolve_deployment(
    model: str,
    *,
    deploy_config: str | None = None,
    stage_configs_path: str | None = None,
    stage_overrides: dict[str, Any] | None = None,
    cli_engine_args: dict[str, Any] | None = None,
    platform: PlatformInfo | None = None,
    backend: Backend | None = None,
) -> ResolvedDeployment:
    """``backend`` (``local`` or ``ray``, the command line's ``--worker-backend``) wins over the file's."""
    loaded = load_config(model, deploy_config=deploy_config, stage_configs_path=stage_configs_path)
    overrides = parse_stage_overrides(stage_overrides) if stage_overrides else None
    return resolve(
        loaded,
        model=model,
        platform=platform,
        cli_engine_args=cli_engine_args,
        stage_overrides=overrides,
        backend=backend,
    )
