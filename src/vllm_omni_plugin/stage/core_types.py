"""Stage core types: what stage clients send to stage processes and what comes back (msgspec).

Naming follows the stage proc/client structure of vllm-omni, which users of both know:
``StageCoreRequest`` / ``StageCoreOutput`` / ``StageCoreOutputs`` and their LLM and Diffusion variants.
Messages are tagged structs so one socket can carry requests, aborts and control messages; they are encoded by
:class:`~vllm_omni_plugin.stage.serialization.StageMessageCodec` (tensors as msgpack extensions, large
payloads as connector handles), never pickled.
"""

from __future__ import annotations

from typing import Any

import msgspec


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


class StageDiffusionCoreRequest(StageCoreRequest, kw_only=True, tag="diffusion_request"):
    diffusion: Any
    """A ``DiffusionRequest`` (tensors inside travel as msgpack extensions)."""


class StageAbort(msgspec.Struct, kw_only=True, tag="abort"):
    request_ids: list[str]


class StageShutdown(msgspec.Struct, kw_only=True, tag="shutdown"):
    pass


class StageReady(msgspec.Struct, kw_only=True, tag="ready"):
    pid: int
    load_seconds: float
    device: str


class StageFailed(msgspec.Struct, kw_only=True, tag="failed"):
    error: str


PROGRESS_REPORT_INTERVAL_S = 0.5
"""How often a working diffusion replica tells its client how many denoising steps it has run (a stage
process, a headless worker, a Ray actor asked by the head)."""


class StageProgress(msgspec.Struct, kw_only=True, tag="progress"):
    """A diffusion replica's running count of denoising steps (per request), sent while it works."""

    denoise_steps: int
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
FromStageMessage = StageCoreOutputs | StageDropped | StageReady | StageFailed | StageProgress
