"""Pipelines: the frozen topology of a multi-stage model, defined in Python.

A pipeline fixes what a deploy file must not be able to change: which stages exist, how each executes,
where its inputs come from, which processor turns one stage's output into the next stage's input, where
its weights live in the model repository and which stage produces the final output. Deploy configs only
say how to *deploy* those stages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from vllm_omni_plugin.config.errors import ConfigError
from vllm_omni_plugin.diffusion.runner import DiffusionDefaults
from vllm_omni_plugin.dotted import import_object

if TYPE_CHECKING:
    from vllm_omni_plugin.config.settings import RequestSettings

ExecutionType = Literal["llm_ar", "diffusion"]
OutputType = Literal["token_ids", "text", "image", "latents"]


class PipelineStage(msgspec.Struct, frozen=True, kw_only=True):
    stage_id: int
    name: str
    execution_type: ExecutionType
    input_sources: tuple[int, ...] = ()
    input_processor: str | None = None
    """Dotted path of the stage-input processor: builds this stage's request from its sources' outputs
    (an entry stage's from the user's request)."""
    model_subdir: str | None = None
    tokenizer_subdir: str | None = None
    engine_args_provider: str | None = None
    """Dotted path of ``f(model_subdir_path) -> dict``: EngineArgs the pipeline derives from the
    checkpoint (AR stages). Values a deploy config sets explicitly win."""
    model_arch: str | None = None
    output_type: OutputType = "token_ids"
    final_output: bool = False
    continuation: str | None = None
    """Dotted path of ``f(output, context) -> request | None``: a stage that works on one request in
    several rounds (BAGEL's thinker writes its plan, then builds the contexts) asks it for the next."""
    exports_context: bool = False
    """An AR stage that hands its KV cache over (BAGEL): resolution gives its engine the context export
    KV connector (``ar_worker/context_export.py``) with the connector of its output edge."""
    context_position: str | None = None
    """Dotted path of ``f(vllm_config, request) -> int``: the position after a request's prompt, sent with
    its exported context (M-RoPE models whose prompt positions are not one per token). None: its length."""
    model_stage_outputs: bool = False
    """The stage's model computes per-request outputs for the next stage (``omni_stage_outputs``, GLM-Image's
    source-image prior tokens). On vLLM's V1 runner they ride its step output; on V2, which has no such
    hook, resolution gives the engine the plugin's KV connector, whose worker metadata carries them."""
    diffusion_runner: str | None = None
    """Dotted path of the runner class of a diffusion stage whose model is not a diffusers pipeline
    (BAGEL's generation runner); None: the runner is chosen by ``model_index.json``."""


class ARTokenCount(msgspec.Struct, frozen=True, kw_only=True):
    """What one request holds in an AR stage's context (``Pipeline.ar_token_budget``), which the stage's
    ``max_model_len`` bounds: vLLM stops a request whose prompt and output reach it."""

    prompt_tokens: int
    """Text: chat template, prompt and any scaffold the processor adds (source images not included)."""
    image_tokens: tuple[int, ...] = ()
    """Per source image."""
    generated_tokens: int = 0
    exact: bool = True
    """False: ``prompt_tokens`` is an upper bound (a budget counts exactly where the bound does not fit)."""
    largest_fit: tuple[int, int] | None = None
    """(width, height): the largest output size of about the asked aspect ratio that would fit, when the
    asked one does not and the prompt and sources leave room for one."""

    @property
    def total(self) -> int:
        return self.prompt_tokens + sum(self.image_tokens) + self.generated_tokens


class Pipeline(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    stages: tuple[PipelineStage, ...]
    model_class_names: tuple[str, ...] = ()
    """``model_index.json`` ``_class_name`` values (diffusers layout) that identify this pipeline."""
    architectures: tuple[str, ...] = ()
    """``config.json`` ``architectures`` entries that identify this pipeline."""
    repo_ids: tuple[str, ...] = ()
    """Hub repository ids of this pipeline's models, for when the model is not a local directory."""
    streaming_processor: str | None = None
    """Processor that streams chunks to the next stage (``async_chunk: true``); None: not supported."""
    default_deploy_config: str | None = None
    """Packaged deploy config (file name under ``deploy/``) used when none is given."""
    image_size_multiple: int = 16
    """Height and width of the images this pipeline makes must be multiples of this."""
    edits_keep_source_size: bool = False
    """An edit makes an image of its source's size, whatever size the request names (BAGEL), so the
    model's size limits bind text-to-image requests only."""
    ar_token_budget: str | None = None
    """Dotted path of ``f(model, prompt, image_sizes, width, height, limit) -> ARTokenCount``: every token
    one request holds in the AR stage (prompt, source images, generated image), so the API server refuses a
    request the AR stage's ``max_model_len`` (``limit``) cannot hold before any stage runs. None: no AR
    stage bounds it."""
    diffusion_defaults: DiffusionDefaults = DiffusionDefaults()
    """What its diffusion stage's requests get for fields they leave unset, where neither the deploy config
    nor the request says (under these: the model's own, ``DiffusionRunner.model_defaults``)."""
    settings: str | None = None
    """Dotted path of the family's request settings type (a ``config.settings.RequestSettings``): the
    fields a request (and the diffusion stage's ``default_sampling_params``) may set beyond OpenAI's, e.g.
    BAGEL's ``cfg_text_scale``. None: none."""
    answers_in_text: bool = False
    """Its AR stage can answer in text (chat completions without ``"modalities": ["image"]``): the
    later stages are skipped (BAGEL's understanding and chat)."""
    any_diffusers_model: bool = False
    """Serves any diffusers pipeline directory (a ``model_index.json``) that no other pipeline claims."""
    model_inspector: str | None = None
    """Dotted path of ``f(model) -> facts``: what the model takes (``takes_images``, ``needs_images``,
    ``pipeline_class``), read from its files when a deployment resolves; raises ``ValueError`` (or
    ``OSError``) with one line when the model cannot be served. None: the pipeline's stages fix that."""

    def stage(self, stage_id: int) -> PipelineStage | None:
        for stage in self.stages:
            if stage.stage_id == stage_id:
                return stage
        return None

    @property
    def stage_ids(self) -> tuple[int, ...]:
        return tuple(s.stage_id for s in self.stages)

    @property
    def final_stage(self) -> PipelineStage:
        return next(s for s in self.stages if s.final_output)

    @property
    def settings_type(self) -> type[RequestSettings] | None:
        """The family's request settings type (imported), or None."""
        return import_object(self.settings) if self.settings else None

    @property
    def setting_names(self) -> tuple[str, ...]:
        """The fields of :attr:`settings_type`."""
        settings = self.settings_type
        return tuple(settings.__struct_fields__) if settings is not None else ()


FAMILY_PIPELINES: dict[str, str] = {
    "glm_image": "vllm_omni_plugin.families.glm_image.pipeline:GLM_IMAGE",
    "bagel": "vllm_omni_plugin.families.bagel.pipeline:BAGEL",
    "diffusion": "vllm_omni_plugin.families.diffusers.pipeline:DIFFUSION",
}
"""The pipelines of the model families in ``families/``, by name -> dotted path of their declaration.
Imported (and registered) when a pipeline is first looked up, in this order (which model detection
follows); generic code names a family by these strings only."""


_PIPELINES: dict[str, Pipeline] = {}


def _load_families() -> None:
    """Register the declared family pipelines not registered yet (an out-of-tree pipeline of the same
    name, registered first, wins)."""
    for name, path in FAMILY_PIPELINES.items():
        if name not in _PIPELINES:
            register_pipeline(import_object(path))


def register_pipeline(pipeline: Pipeline, *, replace: bool = False) -> None:
    """Register a pipeline (also for out-of-tree pipelines). Checks that its graph is well formed."""
    if pipeline.name in _PIPELINES and not replace and _PIPELINES[pipeline.name] != pipeline:
        raise ValueError(f"pipeline {pipeline.name!r} is already registered")
    ids = pipeline.stage_ids
    if len(set(ids)) != len(ids):
        raise ValueError(f"pipeline {pipeline.name!r}: duplicate stage ids {ids}")
    for stage in pipeline.stages:
        for source in stage.input_sources:
            if source not in ids or source == stage.stage_id:
                raise ValueError(
                    f"pipeline {pipeline.name!r}: stage {stage.stage_id} reads from unknown stage {source}"
                )
    if sum(s.final_output for s in pipeline.stages) != 1:
        raise ValueError(f"pipeline {pipeline.name!r}: exactly one stage must be the final output")
    _PIPELINES[pipeline.name] = pipeline


def get_pipeline(name: str) -> Pipeline:
    _load_families()
    try:
        return _PIPELINES[name]
    except KeyError:
        known = ", ".join(sorted(_PIPELINES)) or "none"
        raise ConfigError(f"unknown pipeline {name!r}; registered pipelines: {known}") from None


def registered_pipelines() -> dict[str, Pipeline]:
    _load_families()
    return dict(_PIPELINES)


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def detect_pipeline(model: str) -> Pipeline | None:
    """The pipeline of a model directory (``model_index.json`` / ``config.json``) or hub repo id: the one
    that names its class or architecture, else for a diffusers directory the one that serves any."""
    _load_families()
    root = Path(model)
    if root.is_dir():
        index = _read_json(root / "model_index.json")
        class_name = index.get("_class_name") if index else None
        config = _read_json(root / "config.json")
        architectures = tuple(config.get("architectures") or ()) if config else ()
        for pipeline in _PIPELINES.values():
            if class_name and class_name in pipeline.model_class_names:
                return pipeline
            if set(architectures) & set(pipeline.architectures):
                return pipeline
        if index is not None:
            return next((p for p in _PIPELINES.values() if p.any_diffusers_model), None)
        return None
    for pipeline in _PIPELINES.values():
        if model.rstrip("/") in pipeline.repo_ids:
            return pipeline
    return None
