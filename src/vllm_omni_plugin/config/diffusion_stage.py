"""A diffusion stage's worker arguments, with its request defaults merged once: the stage's field, else
its ``default_sampling_params``, else the pipeline's diffusion defaults."""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_omni_plugin.config.merge import set_fields
from vllm_omni_plugin.config.pipeline import Pipeline
from vllm_omni_plugin.config.platform import PlatformInfo
from vllm_omni_plugin.config.report import Reporter
from vllm_omni_plugin.config.schema import StageDeployConfig
from vllm_omni_plugin.diffusion.engine import MAX_BATCH_SIZE
from vllm_omni_plugin.dotted import import_object

DIFFUSION_DEFAULT_KEYS = ("num_inference_steps", "guidance_scale", "height", "width", "seed")
"""What a diffusion stage's ``default_sampling_params`` may set: defaults of the diffusion engine for
requests that leave them unset (a stage field of the same name wins)."""
DIFFUSION_ENGINE_FIELDS = (
    "dtype",
    "trust_remote_code",
    "enforce_eager",
    "gpu_memory_utilization",
    "batching",
    "batch_wait_ms",
    "max_loras",
    "max_step_tokens",
    "cfg_parallel_size",
    "sequence_parallel_size",
)
"""Further stage fields handed to the diffusion engine as they are."""


def diffusion_args(
    stage: StageDeployConfig,
    sampling: dict[str, Any],
    pipeline: Pipeline,
    model: str,
    platform: PlatformInfo,
    report: Reporter,
) -> dict[str, Any]:
    """The diffusion worker's arguments, its request defaults merged in."""
    if platform.diffusion_worker_cls is None:
        raise report.error(
            f"diffusion stages are not supported on platform {platform.name!r}", stage.stage_id
        )
    pipeline_defaults = set_fields(pipeline.diffusion_defaults)
    args: dict[str, Any] = {
        "model": model,
        "max_batch_size": stage.max_batch_size or MAX_BATCH_SIZE,
        "worker_cls": platform.diffusion_worker_cls,
    }
    fixed = pipeline.stage(stage.stage_id)
    if fixed is not None and fixed.diffusion_runner:
        args["runner_cls"] = fixed.diffusion_runner
        runner_cls = import_object(fixed.diffusion_runner)
        runner_name = fixed.diffusion_runner.rsplit(".", 1)[-1]
        if stage.batching == "step" and not runner_cls.step_batching:
            raise report.error(
                f"step batching is not available for {pipeline.name}'s diffusion runner "
                f"({runner_name}); use batching: request",
                stage.stage_id,
                "batching",
            )
        for field, what, able in (
            ("cfg_parallel_size", "CFG", runner_cls.cfg_parallel),
            ("sequence_parallel_size", "sequence", runner_cls.sequence_parallel),
        ):
            if (getattr(stage, field) or 1) > 1 and not able:
                raise report.error(
                    f"{what} parallelism is not available for {pipeline.name}'s diffusion runner "
                    f"({runner_name}); remove {field}",
                    stage.stage_id,
                    field,
                )
    if (stage.cfg_parallel_size or 1) > 1 and (stage.sequence_parallel_size or 1) > 1:
        raise report.error(
            "cfg_parallel_size and sequence_parallel_size cannot be combined; choose one",
            stage.stage_id,
            "sequence_parallel_size",
        )
    for name in DIFFUSION_ENGINE_FIELDS:
        if getattr(stage, name) is not None:
            args[name] = getattr(stage, name)
    if stage.cache is not None and stage.cache.active:
        args["cache"] = msgspec.to_builtins(stage.cache.resolved())
    if stage.compile is not None and stage.compile.active:
        args["compile"] = msgspec.to_builtins(stage.compile)
    if stage.gpu_memory_utilization is not None and platform.device_env is None:
        report.note_at(
            stage.stage_id,
            "gpu_memory_utilization",
            f"on {platform.name} a share of the machine's memory (as vLLM's CPU backend reads it): "
            "the stage admits requests by their estimated activation memory within it, but nothing "
            "caps what it allocates",
        )
    for name in DIFFUSION_DEFAULT_KEYS:
        for value in (getattr(stage, name), sampling.get(name), pipeline_defaults.get(name)):
            if value is not None:
                args[name] = value
                break
    return dict(sorted(args.items()))
