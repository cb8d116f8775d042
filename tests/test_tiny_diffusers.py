"""The tiny single-stage diffusers models (``sd3``, ``flux``, ``qwen-image``, ``qwen-image-edit``): built
offline and deterministically, small, and made of the real diffusers and transformers component classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_omni_plugin import tiny_models as tiny

pytestmark = pytest.mark.slow

KINDS = {
    "sd3": (
        "StableDiffusion3Pipeline",
        {
            "transformer": "SD3Transformer2DModel",
            "vae": "AutoencoderKL",
            "text_encoder": "CLIPTextModelWithProjection",
            "text_encoder_2": "CLIPTextModelWithProjection",
            "text_encoder_3": "T5EncoderModel",
            "tokenizer": "CLIPTokenizer",
            "tokenizer_2": "CLIPTokenizer",
            "tokenizer_3": "T5Tokenizer",
            "scheduler": "FlowMatchEulerDiscreteScheduler",
        },
    ),
    "flux": (
        "FluxPipeline",
        {
            "transformer": "FluxTransformer2DModel",
            "vae": "AutoencoderKL",
            "text_encoder": "CLIPTextModel",
            "text_encoder_2": "T5EncoderModel",
            "tokenizer": "CLIPTokenizer",
            "tokenizer_2": "T5Tokenizer",
            "scheduler": "FlowMatchEulerDiscreteScheduler",
        },
    ),
    "qwen-image": (
        "QwenImagePipeline",
        {
            "transformer": "QwenImageTransformer2DModel",
            "vae": "AutoencoderKLQwenImage",
            "text_encoder": "Qwen2_5_VLForConditionalGeneration",
            "tokenizer": "Qwen2Tokenizer",
            "scheduler": "FlowMatchEulerDiscreteScheduler",
        },
    ),
    "qwen-image-edit": (
        "QwenImageEditPipeline",
        {
            "transformer": "QwenImageTransformer2DModel",
            "vae": "AutoencoderKLQwenImage",
            "text_encoder": "Qwen2_5_VLForConditionalGeneration",
            "tokenizer": "Qwen2Tokenizer",
            "processor": "Qwen2VLProcessor",
            "scheduler": "FlowMatchEulerDiscreteScheduler",
        },
    ),
}


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_build_is_deterministic_small_and_of_the_real_classes(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cached = request.getfixturevalue(f"tiny_{kind.replace('-', '_')}")
    again = tiny.build(kind, tmp_path / kind)
    assert _tree(again) == _tree(cached)  # byte for byte, weights included
    assert sum(len(blob) for blob in _tree(cached).values()) < 8 * 1024 * 1024
    pipeline, components = KINDS[kind]
    index = json.loads((cached / "model_index.json").read_text())
    assert index["_class_name"] == pipeline
    assert {name: index[name][1] for name in components} == components
    assert all(index[name][0] in ("diffusers", "transformers") for name in components)


def test_qwen_tokenizer_ends_the_system_prompt_where_the_real_one_does(tiny_qwen_image: Path) -> None:
    """The pipelines drop the template's first 34 (edit: 64) hidden states, the system prompt's tokens."""
    from transformers import AutoTokenizer

    from vllm_omni_plugin.tiny_models.qwen_image import _templates

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen_image / "tokenizer")
    for template, drop in _templates():
        ids = tokenizer(template.format("a red fox")).input_ids
        assert tokenizer.decode(ids[:drop]).endswith("<|im_start|>user\n")
        assert "red fox" in tokenizer.decode(ids[drop:])
        assert tokenizer.unk_token_id not in ids


def test_tokenizers_know_how_people_write_prompts(tiny_sd3: Path) -> None:
    """Capitals, digits and punctuation never become the unknown token (CLIP's unknown is its end token,
    which would end the prompt early for the pooled embedding)."""
    from transformers import AutoTokenizer

    prompt = "A Photo of 2 cats, sitting (quietly) on a mat; 100% cute!"
    for sub in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        tokenizer = AutoTokenizer.from_pretrained(tiny_sd3 / sub)
        ids = tokenizer(prompt).input_ids
        inner = ids[1:-1] if sub != "tokenizer_3" else ids[:-1]
        assert tokenizer.unk_token_id not in inner and tokenizer.eos_token_id not in inner, sub
