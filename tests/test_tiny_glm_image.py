"""The tiny GLM-Image: deterministic build, real layout, and diffusers runs it end to end and split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_omni_plugin import tiny_models as tiny
from vllm_omni_plugin.families.glm_image.processors import glm_image_grid, glm_image_max_new_tokens
from vllm_omni_plugin.tiny_models.glm_image import GLM_IMAGE_CODEBOOK_SIZE

pytestmark = pytest.mark.slow

PROMPT = "A photo of a cat"
SIZE = 64
STEPS = 4
SEED = 42

COMPONENTS = (
    "processor",
    "scheduler",
    "text_encoder",
    "tokenizer",
    "transformer",
    "vae",
    "vision_language_encoder",
)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_glm_image_build_is_deterministic_and_cached(tmp_path: Path) -> None:
    a = tiny.build("glm-image", tmp_path / "a")
    b = tiny.build("glm-image", tmp_path / "b")
    files_a = _tree(a)
    assert files_a == _tree(b)
    assert {name.split("/")[0] for name in files_a} >= {*COMPONENTS, "model_index.json"}
    assert sum(len(data) for data in files_a.values()) < 64 * 2**20
    weights = a / "vision_language_encoder" / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert tiny.build("glm-image", a) == a  # cache hit: nothing rewritten
    assert weights.stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    ("height", "width", "expected"),
    [
        (64, 64, (2, 2, 16, 16)),
        (128, 128, (4, 4, 16, 16)),
        (1024, 512, (32, 16, 22, 11)),
        (100, 64, (3, 2, 19, 13)),
    ],
)
def test_glm_image_grid_matches_the_processor(height: int, width: int, expected: tuple) -> None:
    from transformers import GlmImageProcessor

    assert glm_image_grid(height, width) == expected
    th, tw, ph, pw = expected
    assert (th, tw, ph, pw) == GlmImageProcessor._get_target_shape(None, height=height, width=width)
    assert glm_image_max_new_tokens(height, width) == th * tw + ph * pw + 1
    assert glm_image_max_new_tokens(height, width, image_to_image=True) == th * tw + 1


def test_glm_image_layout(tiny_glm_image: Path) -> None:
    from transformers import AutoTokenizer, GlmImageConfig

    index = json.loads((tiny_glm_image / "model_index.json").read_text())
    assert index["_class_name"] == "GlmImagePipeline"
    assert index["vision_language_encoder"] == ["transformers", "GlmImageForConditionalGeneration"]
    assert index["processor"] == ["transformers", "GlmImageProcessor"]
    assert index["transformer"] == ["diffusers", "GlmImageTransformer2DModel"]
    assert index["tokenizer"] == ["transformers", "ByT5Tokenizer"]

    config = GlmImageConfig.from_pretrained(tiny_glm_image / "vision_language_encoder")
    text = config.text_config
    assert (text.vocab_size, text.vision_vocab_size) == (168064, 16512)
    assert text.hidden_size // text.num_attention_heads == 32
    assert text.rope_parameters["mrope_section"] == [2, 3, 3]
    assert config.dtype == "bfloat16" or str(config.dtype) == "torch.bfloat16"
    generation = json.loads(
        (tiny_glm_image / "vision_language_encoder" / "generation_config.json").read_text()
    )
    assert generation["do_sample"] and generation["eos_token_id"] == 16385

    tok = AutoTokenizer.from_pretrained(tiny_glm_image / "processor")
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<sop>", "<eop>", "<|image|>", "<|dit_token_7|>"])
    assert ids == [167841, 167845, 167846, 167855, 7]
    assert (tok.bos_token_id, tok.eos_token_id) == (16384, 16385)
    assert (tok.image_token, tok.grid_bos_token, tok.grid_eos_token) == ("<|image|>", "<sop>", "<eop>")
    for number in ("2", " 2", "16", " 16"):
        assert len(tok(number, add_special_tokens=False).input_ids) == 1


@pytest.mark.filterwarnings("ignore:`torch_dtype` is deprecated:FutureWarning")
def test_glm_image_pipeline_end_to_end_equals_ar_plus_dit(tiny_glm_image: Path) -> None:
    import numpy as np
    import torch
    from diffusers import GlmImagePipeline
    from transformers import GlmImageForConditionalGeneration, GlmImageProcessor

    th, tw, ph, pw = glm_image_grid(SIZE, SIZE)

    # End to end: the pipeline's own AR run feeds its DiT.
    pipe = GlmImagePipeline.from_pretrained(tiny_glm_image, torch_dtype=torch.float32)
    image = pipe(
        PROMPT,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(SEED),
        output_type="np",
    ).images[0]
    assert image.shape == (SIZE, SIZE, 3) and np.isfinite(image).all()
    del pipe

    # Split: the AR alone, the way the pipeline calls it ...
    processor = GlmImageProcessor.from_pretrained(tiny_glm_image / "processor")
    messages = [[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]]
    prompt_text = processor.apply_chat_template(messages, tokenize=False, target_h=SIZE, target_w=SIZE)
    assert prompt_text == [PROMPT]
    inputs = processor.apply_chat_template(
        messages, tokenize=True, target_h=SIZE, target_w=SIZE, return_dict=True, return_tensors="pt"
    )
    tokens = processor.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    assert tokens[-9:] == ["<sop>", "2", "Ġ2", "<eop>", "<sop>", "16", "Ġ16", "<eop>", "<|dit_token_16384|>"]
    assert inputs["image_grid_thw"].tolist() == [[1, th, tw], [1, ph, pw]]
    ar = GlmImageForConditionalGeneration.from_pretrained(
        tiny_glm_image / "vision_language_encoder", dtype=torch.float32
    )
    torch.manual_seed(SEED)
    out = ar.generate(**inputs, max_new_tokens=glm_image_max_new_tokens(SIZE, SIZE), do_sample=True)
    generated = out[0, inputs["input_ids"].shape[1] :]
    assert generated.numel() == th * tw + ph * pw + 1
    assert int(generated.max()) < GLM_IMAGE_CODEBOOK_SIZE
    assert len(set(generated.tolist())) > 16  # random, not stuck on one id
    del ar

    # ... then the DiT alone on the upsampled large-grid tokens.
    large = generated[ph * pw : ph * pw + th * tw].view(1, 1, th, tw)
    prior = torch.nn.functional.interpolate(large.float(), scale_factor=2, mode="nearest").long().view(1, -1)
    dit = GlmImagePipeline.from_pretrained(
        tiny_glm_image, vision_language_encoder=None, processor=None, torch_dtype=torch.float32
    )
    split = dit(
        PROMPT,
        prior_token_ids=prior,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(SEED),
        output_type="np",
    ).images[0]
    np.testing.assert_array_equal(split, image)
