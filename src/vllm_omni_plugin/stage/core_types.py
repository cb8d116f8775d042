"""Stage core types: what stage clients send to stage processes and what comes back (msgspec).

Naming follows the stage proc/client structure of vllm-omni, which users of both know:
``StageCoreRequest`` / ``StageCoreOutput`` / ``StageCoreOutputs`` and their LLM and Diffusion variants.
Messages are tagged structs so one socket can carry requests, aborts and control messages; they are encoded by
:class:`~vllm_omni_plugin.stage.serialization.StageMessageCodec` (tensors as msgpack extensions, large
payloads as connector handles), never pickled.
"""

from __future__ import annotations

import functools
from typing import Any, Generic, TypeVar, Union

import msgspec

from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

DiffusionT = TypeVar("DiffusionT")


class StageCoreRequest(msgspec.Struct, kw_only=True, tag=True):
    request_id: str
    stage_id: int


class StageLLMCoreRequest(StageCoreRequest, kw_only=True, tag="llm_request"):
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any] = {}
    multi_modal_data: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    """Per-request arguments of the model's multimodal processor (e.g. BAGEL's ``bagel_vae``)."""
    companions: dict[str, StageLLMCoreRequest] = {}
    """Requests that belong to this one and run beside it in the same engine (a KV-handoff pipeline's
    other contexts, by name); their outputs come back in the output's ``companions``, all or none."""
    companion_timeout_s: float = 30.0
    """How long the companions may take once the main request is done before the request fails with
    the names of those missing."""
    priority: int = 0
    """vLLM's request priority (lower first), where the stage's engine has ``scheduling_policy:
    priority``; its companions carry the same."""


class StageDiffusionCoreRequest(StageCoreRequest, Generic[DiffusionT], kw_only=True, tag="diffusion_request"):
    diffusion: DiffusionT
    """The runner's request, one of the registered runners' request types (tagged by ``kind``; tensors
    inside travel as msgpack extensions or connector handles). Decoders parametrize it with their union
    (:func:`diffusion_request_union`); unparametrized it decodes as plain data."""
    alone: bool = False
    """Run it in a batch of its own, with nothing else in flight beside it: the run again of a request
    whose batch's process died, so that a request that kills its stage takes nobody else down."""


class StageAbort(msgspec.Struct, kw_only=True, tag="abort"):
    request_ids: list[str]


class StageShutdown(msgspec.Struct, kw_only=True, tag="shutdown"):
    pass


class StageReady(msgspec.Struct, kw_only=True, tag="ready"):
    pid: int
    load_seconds: float
    device: str
    weight_bytes: int = 0
    """A diffusion replica's weights as its engine holds them (quantized ones by their real size)."""


class StageFailed(msgspec.Struct, kw_only=True, tag="failed"):
    error: str


PROGRESS_REPORT_INTERVAL_S = 0.5
"""How often a working diffusion replica tells its client how many denoising steps it has run (a stage
process, a headless worker, a Ray actor asked by the head)."""


class StageProgress(msgspec.Struct, kw_only=True, tag="progress"):
    """A diffusion replica's running counts (denoising steps, step and queue times), sent while it works."""

    counters: DiffusionCounters
    pid: int = 0
    """The stage process that sent it (its client ignores what a process it replaced sent)."""
    steps: dict[str, tuple[int, int]] = {}
    """(steps done, steps in all) of each request it is denoising."""


class StagePreview(msgspec.Struct, kw_only=True, tag="preview"):
    """A preview of a request's image, decoded mid-denoising (``partial_images``)."""

    request_id: str
    index: int
    image: Any
    """uint8 HxWx3."""
    pid: int = 0
    """The stage process that sent it (its client ignores what a process it replaced sent)."""


class StageDropped(msgspec.Struct, kw_only=True, tag="dropped"):
    """A stage process dropped aborted requests and will send nothing for them."""

    request_ids: list[str]
    where: str
    """``queue`` (had not started) or ``batch`` (dropped from the running batch; no image was made)."""
    pid: int = 0
    """The stage process that sent it (its client ignores what a process it replaced sent)."""


class StageCoreOutput(msgspec.Struct, kw_only=True, tag=True):
    request_id: str
    stage_id: int
    error: str | None = None
    timings: dict[str, float] = {}


class StageLLMCoreOutput(StageCoreOutput, kw_only=True, tag="llm_output"):
    token_ids: list[int] = []
    text: str | None = None
    """The detokenized text, when the request asked for it (a text answer)."""
    num_prompt_tokens: int = 0
    finish_reason: str | None = None
    stage_outputs: dict[str, Any] = {}
    """Per-request outputs of the AR worker beyond tokens (e.g. source-image prior tokens)."""
    companions: dict[str, StageLLMCoreOutput] = {}
    """The outputs of the request's companions, by name."""


class StageDiffusionCoreOutput(StageCoreOutput, kw_only=True, tag="diffusion_output"):
    invalid: bool = False
    """``error`` is the stage refusing the request (a bad value: HTTP 400), not failing to run it."""
    image: Any = None
    """A uint8 HxWx3 array, inline (in-process) or fetched from ``image_handle``."""
    image_handle: Any = None
    """A connector handle (dict form) when the image travelled through a connector."""
    latents: Any = None


class StageCoreOutputs(msgspec.Struct, kw_only=True, tag="outputs"):
    outputs: list[StageLLMCoreOutput | StageDiffusionCoreOutput]
    pid: int = 0
    """The stage process that sent them (its client ignores what a process it replaced sent)."""


# What each direction of a stage process's sockets carries.
ToStageMessage = StageDiffusionCoreRequest | StageLLMCoreRequest | StageAbort | StageShutdown
"""Untyped diffusion part: for encoding, and for naming a request whose part no runner takes."""


def diffusion_request_types() -> tuple[type, ...]:
    """The request types of every registered runner: the diffusers runners (``register_diffusion_pipeline``)
    and those pipelines name (``Pipeline.diffusion_runner``), imported by dotted path. A runner that
    cannot be imported is left out (its requests are then refused by kind), with a warning."""
    from vllm_omni_plugin.config.pipeline import registered_pipelines
    from vllm_omni_plugin.diffusion.diffusers_registry import diffusers_runner_classes
    from vllm_omni_plugin.dotted import import_object

    runners: list[Any] = list(diffusers_runner_classes())
    for pipeline in registered_pipelines().values():
        for stage in pipeline.stages:
            if stage.diffusion_runner:
                try:
                    runners.append(import_object(stage.diffusion_runner))
                except Exception as exc:
                    _warn_unimportable(stage.diffusion_runner, f"{type(exc).__name__}: {exc}")
    types: list[type] = []
    for runner in runners:
        if runner.request_type not in types:
            types.append(runner.request_type)
    return tuple(types)


@functools.cache
def _warn_unimportable(path: str, reason: str) -> None:
    logger.warning("diffusion runner %s cannot be imported (%s); its requests will be refused", path, reason)


def diffusion_request_union() -> Any:
    """The union of the registered runners' request types, built now (the registry may have grown)."""
    return Union[diffusion_request_types()]  # noqa: UP007 (a union built at run time)


def to_stage_message_type() -> Any:
    """What a stage process decodes: ``ToStageMessage`` with the diffusion part typed by the registry."""
    return (
        StageDiffusionCoreRequest[diffusion_request_union()]
        | StageLLMCoreRequest
        | StageAbort
        | StageShutdown
    )


FromStageMessage = StageCoreOutputs | StageDropped | StageReady | StageFailed | StageProgress | StagePreview
