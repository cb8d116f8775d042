"""A diffusion stage's worker arguments, and its request defaults merged once: the stage's field, else its
``default_sampling_params``, else the pipeline's diffusion defaults (the input processor applies them;
nothing of them reaches the stage's worker)."""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_omni_plugin.config.merge import set_fields
from vllm_omni_plugin.config.pipeline import Pipeline
from vllm_omni_plugin.config.platform import PlatformInfo
from vllm_omni_plugin.config.report import Reporter
from vllm_omni_plugin.config.schema import StageDeployConfig
from vllm_omni_plugin.diffusion.diffusers_registry import stage_runner_class
from vllm_omni_plugin.diffusion.engine_config import DiffusionEngineConfig
from vllm_omni_plugin.diffusion.quantization import SCHEMES, QuantizationSpec
from vllm_omni_plugin.diffusion.quantization import check as check_quantization
from vllm_omni_plugin.diffusion.runner import MAX_BATCH_SIZE
from vllm_omni_plugin.dotted import import_object

REQUEST_DEFAULT_KEYS = ("num_inference_steps", "guidance_scale", "height", "width")
"""What a diffusion stage's ``default_sampling_params`` may set for requests that leave them unset (a stage
field of the same name wins): the stage's ``request_defaults``."""
DIFFUSION_DEFAULT_KEYS = (*REQUEST_DEFAULT_KEYS, "seed")
"""Those, and ``seed``: it seeds the engine's draw of seeds for unseeded requests."""
SET_BY_DIFFUSION_ARGS = ("max_batch_size", "seed", "cache", "compile", "quantization")
"""Stage fields the engine's configuration also has that ``diffusion_args`` resolves itself."""
DIFFUSION_ENGINE_FIELDS = tuple(
    name
    for name in DiffusionEngineConfig.__struct_fields__
    if name in StageDeployConfig.__struct_fields__ and name not in SET_BY_DIFFUSION_ARGS
)
"""The other stage fields of the engine's configuration, handed to it as they are when set."""


def diffusion_args(
    stage: StageDeployConfig,
    sampling: dict[str, Any],
    pipeline: Pipeline,
    model: str,
    platform: PlatformInfo,
    report: Reporter,
) -> dict[str, Any]:
    """The diffusion worker's arguments (its ``seed`` merged as the request defaults are)."""
    if platform.diffusion_worker_cls is None:
        raise report.error(
            f"diffusion stages are not supported on platform {platform.name!r}", stage.stage_id
        )
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
    args.setdefault("scheduling_policy", "fcfs")  # shown by --print-resolved-config whether set or not
    if stage.quantization is not None:
        try:
            spec = QuantizationSpec.of(stage.quantization)
        except (msgspec.ValidationError, ValueError) as exc:
            schemes = ", ".join((*SCHEMES, "gguf"))
            raise report.error(f"{exc} (schemes: {schemes})", stage.stage_id, "quantization") from None
        if spec is not None and spec.active:
            try:
                runner = stage_runner_class({**args, "model": model})
            except (OSError, ValueError):  # the model is not readable here: its stage says so as it starts
                runner = None
            if runner is not None and not runner.quantizes:
                raise report.error(
                    f"quantization is not available for {pipeline.name}'s diffusion runner "
                    f"({runner.__name__})",
                    stage.stage_id,
                    "quantization",
                )
            try:
                check_quantization(spec, "cpu" if platform.device_env is None else "cuda")
            except ValueError as exc:
                raise report.error(str(exc), stage.stage_id, "quantization") from None
            args["quantization"] = msgspec.to_builtins(spec)
    if stage.cache is not None and stage.cache.active:
        args["cache"] = msgspec.to_builtins(stage.cache.resolved())
    if stage.compile is not None and stage.compile.active:
        spec = stage.compile
        defaults = request_defaults(stage, sampling, pipeline)
        if spec.warmup_sizes is None and defaults.get("height") and defaults.get("width"):
            spec = msgspec.structs.replace(spec, warmup_sizes=[(defaults["height"], defaults["width"])])
        elif spec.warmup_sizes is None:
            report.note_at(
                stage.stage_id,
                "compile",
                "no warm-up size: set warmup_sizes (or the stage's height and width); until then the "
                "first request of each size compiles",
            )
        args["compile"] = msgspec.to_builtins(spec)
    if stage.gpu_memory_utilization is not None and platform.device_env is None:
        report.note_at(
            stage.stage_id,
            "gpu_memory_utilization",
            f"on {platform.name} a share of the machine's memory (as vLLM's CPU backend reads it): "
            "the stage admits requests by their estimated activation memory within it, but nothing "
            "caps what it allocates",
        )
    seed = _first_set(stage, sampling, pipeline, "seed")
    if seed is not None:
        args["seed"] = seed
    return dict(sorted(args.items()))


def request_defaults(
    stage: StageDeployConfig, sampling: dict[str, Any], pipeline: Pipeline
) -> dict[str, Any]:
    """What the stage's requests get for fields they leave unset (the input processor applies them, over
    the model's own)."""
    found = {name: _first_set(stage, sampling, pipeline, name) for name in REQUEST_DEFAULT_KEYS}
    return {name: value for name, value in sorted(found.items()) if value is not None}


def _first_set(stage: StageDeployConfig, sampling: dict[str, Any], pipeline: Pipeline, name: str) -> Any:
    """The stage's field, else its ``default_sampling_params``' value, else the pipeline's default."""
    declared = set_fields(pipeline.diffusion_defaults)
    return next(
        (v for v in (getattr(stage, name), sampling.get(name), declared.get(name)) if v is not None), None
    )
