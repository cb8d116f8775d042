"""Pipelines: the frozen topology of a multi-stage model, defined in Python.

A pipeline fixes what a deploy file must not be able to change: which stages exist, how each executes,
where its inputs come from, which processor turns one stage's output into the next stage's input, where
its weights live in the model repository and which stage produces the final output. Deploy configs only
say how to *deploy* those stages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import msgspec

from vllm_omni_plugin.config.errors import ConfigError

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
    KV connector (``runners/context_export.py``) with the connector of its output edge."""
    context_position: str | None = None
    """Dotted path of ``f(vllm_config, request) -> int``: the position after a request's prompt, sent with
    its exported context (M-RoPE models whose prompt positions are not one per token). None: its length."""
    v1_runner: str | None = None
    """Why this AR stage runs on vLLM's V1 model runner where vLLM would pick V2 (CUDA/ROCm, vLLM
    0.31-0.33): resolution sets ``VLLM_USE_V2_MODEL_RUNNER=0`` in its replicas' environment and logs this.
    A user who sets the variable wins."""
    images_need_v1_runner: bool = False
    """Source images (image-to-image) need vLLM's V1 model runner here: what the stage hands the next
    stage about them travels on the V1 runner's step output. On V2 the server refuses them (400)."""
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


class DiffusionDefaults(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the pipeline's diffusion stage uses when neither a request nor the deploy config says
    (``None``: the diffusion runner's own default)."""

    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None


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
    generation_params: tuple[str, ...] = ()
    """Pipeline-specific generation settings a request (and the diffusion stage's
    ``default_sampling_params``) may set, e.g. BAGEL's ``cfg_text_scale``."""
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


_PIPELINES: dict[str, Pipeline] = {}


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
    try:
        return _PIPELINES[name]
    except KeyError:
        known = ", ".join(sorted(_PIPELINES)) or "none"
        raise ConfigError(f"unknown pipeline {name!r}; registered pipelines: {known}") from None


def registered_pipelines() -> dict[str, Pipeline]:
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


GLM_IMAGE = Pipeline(
    name="glm_image",
    stages=(
        PipelineStage(
            stage_id=0,
            name="ar",
            execution_type="llm_ar",
            model_subdir="vision_language_encoder",
            tokenizer_subdir="processor",
            input_processor="vllm_omni_plugin.stage.processors.glm_image.request2ar",
            engine_args_provider="vllm_omni_plugin.models.glm_image_config.sampling_vocab_overrides",
            model_arch="GlmImageForConditionalGeneration",
            output_type="token_ids",
            v1_runner=(
                "image-to-image hands the source images' prior tokens to the DiT through the V1 runner's "
                "step output, and the V1 runner is the one the CPU test suite runs"
            ),
            images_need_v1_runner=True,
        ),
        PipelineStage(
            stage_id=1,
            name="dit",
            execution_type="diffusion",
            input_sources=(0,),
            input_processor="vllm_omni_plugin.stage.processors.glm_image.ar2diffusion",
            model_arch="GlmImagePipeline",
            output_type="image",
            final_output=True,
        ),
    ),
    model_class_names=("GlmImagePipeline",),
    architectures=("GlmImageForConditionalGeneration",),
    repo_ids=("zai-org/GLM-Image",),
    default_deploy_config="glm_image.yaml",
    image_size_multiple=32,  # one AR token per 32x32 pixels
    ar_token_budget="vllm_omni_plugin.stage.processors.glm_image.glm_image_ar_tokens",
    diffusion_defaults=DiffusionDefaults(height=1024, width=1024),
)

DIFFUSION = Pipeline(
    name="diffusion",
    stages=(
        PipelineStage(
            stage_id=0,
            name="diffusion",
            execution_type="diffusion",
            input_processor="vllm_omni_plugin.stage.processors.diffusion.request2diffusion",
            output_type="image",
            final_output=True,
        ),
    ),
    default_deploy_config="diffusion.yaml",
    image_size_multiple=16,  # VAE x8 and 2x2 latent patches (SD3, FLUX, Qwen-Image); SD 1.x/XL need 8
    any_diffusers_model=True,
    model_inspector="vllm_omni_plugin.diffusion.pipelines.inspect_model",
)
"""One diffusion stage running a diffusers pipeline, its runner chosen by the model's class."""

register_pipeline(GLM_IMAGE)

BAGEL_PROCESSORS = "vllm_omni_plugin.stage.processors.bagel"
BAGEL = Pipeline(
    name="bagel",
    stages=(
        PipelineStage(
            stage_id=0,
            name="thinker",
            execution_type="llm_ar",
            input_processor=f"{BAGEL_PROCESSORS}.request2thinker",
            continuation=f"{BAGEL_PROCESSORS}.continue_thinker",
            engine_args_provider="vllm_omni_plugin.models.bagel.engine_args.thinker_engine_args",
            model_arch="OmniBagelForConditionalGeneration",
            output_type="token_ids",
            exports_context=True,
            context_position="vllm_omni_plugin.models.bagel_thinker.context_next_position",
            v1_runner=(
                "the V1 runner is the one the CPU test suite runs end to end (vLLM's CPU V2 runner needs "
                "Triton's CPU backend); the thinker's hooks (KV connector, stock M-RoPE positions) also "
                "work on V2"
            ),
        ),
        PipelineStage(
            stage_id=1,
            name="dit",
            execution_type="diffusion",
            input_sources=(0,),
            input_processor=f"{BAGEL_PROCESSORS}.thinker2dit",
            diffusion_runner="vllm_omni_plugin.diffusion.bagel.runner.BagelGenerationRunner",
            output_type="image",
            final_output=True,
        ),
    ),
    architectures=("BagelForConditionalGeneration",),
    repo_ids=("ByteDance-Seed/BAGEL-7B-MoT",),
    default_deploy_config="bagel.yaml",
    answers_in_text=True,
    image_size_multiple=16,  # one latent token per 16x16 pixels
    edits_keep_source_size=True,
    diffusion_defaults=DiffusionDefaults(height=1024, width=1024),
    generation_params=(
        "cfg_text_scale",
        "cfg_img_scale",
        "cfg_interval",
        "cfg_renorm_type",
        "cfg_renorm_min",
        "timestep_shift",
        "think",
        "max_think_tokens",
    ),
)

register_pipeline(BAGEL)

register_pipeline(DIFFUSION)
