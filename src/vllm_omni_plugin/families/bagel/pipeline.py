"""BAGEL's pipeline: its thinker (vLLM, ``models/bagel_thinker.py``) builds the context caches and hands
them over; its generation stage (``runner.BagelGenerationRunner``, no diffusers pipeline) draws the image."""

from __future__ import annotations

from vllm_omni_plugin.config.pipeline import DiffusionDefaults, Pipeline, PipelineStage

BAGEL_PROCESSORS = "vllm_omni_plugin.families.bagel.processors"
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
        ),
        PipelineStage(
            stage_id=1,
            name="dit",
            execution_type="diffusion",
            input_sources=(0,),
            input_processor=f"{BAGEL_PROCESSORS}.thinker2dit",
            diffusion_runner="vllm_omni_plugin.families.bagel.runner.BagelGenerationRunner",
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
    settings="vllm_omni_plugin.families.bagel.settings.BagelSettings",
)
