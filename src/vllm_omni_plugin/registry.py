"""What ``register()`` registers with vLLM, as lazy dotted strings.

Each entry is imported by vLLM only when it is used, so registering costs no heavy import. Model
architectures that stock vLLM lacks are added to ``MODEL_ARCHITECTURES`` by the issues that implement
them.
"""

from __future__ import annotations

# architecture name (config.json "architectures") -> "module:Class"
MODEL_ARCHITECTURES: dict[str, str] = {
    # GLM-Image's AR model (the vision_language_encoder); stock vLLM has none.
    "GlmImageForConditionalGeneration": (
        "vllm_omni_plugin.models.glm_image_ar:GlmImageForConditionalGeneration"
    ),
    # BAGEL's thinker: stock vLLM's BagelForConditionalGeneration extended for generation. A name of its
    # own, so plain vLLM keeps serving stock BAGEL; the bagel pipeline selects it through hf_overrides.
    "OmniBagelForConditionalGeneration": (
        "vllm_omni_plugin.models.bagel_thinker:OmniBagelForConditionalGeneration"
    ),
}


def register_all() -> None:
    if MODEL_ARCHITECTURES:
        from vllm_omni_plugin.compat import resolve

        model_registry = resolve("ModelRegistry")
        supported = set(model_registry.get_supported_archs())
        for arch, target in MODEL_ARCHITECTURES.items():
            if arch not in supported:
                model_registry.register_model(arch, target)
