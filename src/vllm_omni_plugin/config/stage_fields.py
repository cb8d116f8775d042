"""Checks every stage's fields go through, AR or diffusion: fields of the other kind, where the stage runs
(its own process, a headless worker) and its ``default_sampling_params``."""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.config.diffusion_stage import DIFFUSION_DEFAULT_KEYS
from vllm_omni_plugin.config.merge import set_fields
from vllm_omni_plugin.config.pipeline import Pipeline, PipelineStage
from vllm_omni_plugin.config.report import Reporter
from vllm_omni_plugin.config.schema import AR_ONLY_FIELDS, DIFFUSION_ONLY_FIELDS, Backend, StageDeployConfig
from vllm_omni_plugin.config.vllm_fields import check_sampling_params, sampling_param_fields


def check_not_applicable(stage: StageDeployConfig, fixed: PipelineStage, report: Reporter) -> None:
    wrong = AR_ONLY_FIELDS if fixed.execution_type == "diffusion" else DIFFUSION_ONLY_FIELDS
    for name in set_fields(stage):
        if name in wrong:
            report.note_at(stage.stage_id, name, f"does not apply to a {fixed.execution_type} stage; ignored")


def process_mode(
    stage: StageDeployConfig, fixed: PipelineStage, backend: Backend, report: Reporter
) -> tuple[bool, bool]:
    """(runs in its own process, served by a headless worker)."""
    sid, is_ar = fixed.stage_id, fixed.execution_type == "llm_ar"
    if not is_ar and (stage.tensor_parallel_size or 1) != 1:
        raise report.error("diffusion stages run with tensor_parallel_size 1", sid, "tensor_parallel_size")
    process = True if stage.process is None else stage.process
    if is_ar and not process:
        raise report.error("the AR stage always runs in its own vLLM EngineCore process", sid, "process")
    headless = bool(stage.headless)
    if backend == "ray" and headless:
        raise report.error(
            "backend ray places every stage on the Ray cluster; a headless stage (a worker started by "
            "hand) cannot be one of them: drop headless or use backend local",
            sid,
            "headless",
        )
    if backend == "ray" and not process:
        raise report.error(
            "backend ray runs every stage replica as a Ray actor; drop process: false", sid, "process"
        )
    if headless and not process:
        raise report.error(
            "a headless stage runs in processes of its own on its worker; drop process: false",
            sid,
            "process",
        )
    return process, headless


def sampling_params(
    stage: StageDeployConfig, fixed: PipelineStage, pipeline: Pipeline, report: Reporter
) -> dict[str, Any]:
    """``default_sampling_params``: a diffusion stage's known to its engine or pipeline, an AR stage's
    accepted by vLLM's SamplingParams."""
    params = dict(stage.default_sampling_params or {})
    sid = stage.stage_id
    if fixed.execution_type == "diffusion":
        known = {*DIFFUSION_DEFAULT_KEYS, *pipeline.setting_names}
        unknown = sorted(set(params) - known)
        if unknown:
            raise report.error(
                f"unknown diffusion sampling parameter(s) {', '.join(unknown)}, which would have no "
                f"effect (known: {', '.join(sorted(known))})",
                sid,
                "default_sampling_params",
            )
        return params
    unknown = sorted(set(params) - sampling_param_fields())
    if unknown:
        raise report.error(
            f"{', '.join(unknown)}: not a vLLM SamplingParams field", sid, "default_sampling_params"
        )
    problem = check_sampling_params(params)
    if problem is not None:
        raise report.error(f"rejected by vLLM: {problem}", sid, "default_sampling_params")
    return params
