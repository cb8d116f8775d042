"""GLM-Image's pipeline: its AR stage (vLLM, ``models/glm_image_ar.py``) writes the image's prior tokens,
its DiT stage (diffusers' ``GlmImagePipeline`` on ``runner.GlmImageRunner``) draws them."""

from __future__ import annotations

from vllm_omni_plugin.config.pipeline import DiffusionDefaults, Pipeline, PipelineStage

GLM_IMAGE = Pipeline(
    name="glm_image",
    stages=(
        PipelineStage(
            stage_id=0,
            name="ar",
            execution_type="llm_ar",
            model_subdir="vision_language_encoder",
            tokenizer_subdir="processor",
            input_processor="vllm_omni_plugin.families.glm_image.processors.request2ar",
            engine_args_provider="vllm_omni_plugin.models.glm_image_config.sampling_vocab_overrides",
            model_arch="GlmImageForConditionalGeneration",
            output_type="token_ids",
            model_stage_outputs=True,
        ),
        PipelineStage(
            stage_id=1,
            name="dit",
            execution_type="diffusion",
            input_sources=(0,),
            input_processor="vllm_omni_plugin.families.glm_image.processors.ar2diffusion",
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
    ar_token_budget="vllm_omni_plugin.families.glm_image.processors.glm_image_ar_tokens",
    diffusion_defaults=DiffusionDefaults(height=1024, width=1024),
    settings="vllm_omni_plugin.families.glm_image.settings.GlmImageSettings",
)
