"""The single-stage ``diffusion`` pipeline: any diffusers pipeline directory no other pipeline claims, its
runner chosen by the model's ``model_index.json`` class (``diffusion/diffusers_registry.py``)."""

from __future__ import annotations

from vllm_omni_plugin.config.pipeline import Pipeline, PipelineStage

DIFFUSION = Pipeline(
    name="diffusion",
    stages=(
        PipelineStage(
            stage_id=0,
            name="diffusion",
            execution_type="diffusion",
            input_processor="vllm_omni_plugin.families.diffusers.processors.request2diffusion",
            output_type="image",
            final_output=True,
        ),
    ),
    default_deploy_config="diffusion.yaml",
    image_size_multiple=16,  # VAE x8 and 2x2 latent patches (SD3, FLUX, Qwen-Image); SD 1.x/XL need 8
    any_diffusers_model=True,
    model_inspector="vllm_omni_plugin.diffusion.diffusers_registry.inspect_model",
    settings="vllm_omni_plugin.families.diffusers.settings.DiffusersSettings",
)
"""One diffusion stage running a diffusers pipeline, its runner chosen by the model's class."""
