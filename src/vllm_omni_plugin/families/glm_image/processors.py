"""GLM-Image's stage-input processors: the user's request -> the AR stage, AR output -> the DiT stage.

The AR stage (GLM-Image's vision_language_encoder in vLLM) must see the target size in its prompt: the
processor's chat template appends the grid scaffold ``<sop>th tw<eop>[<sop>ph pw<eop>]`` and the image
start token. It then emits (t2i) a preview grid, the large grid and an end token, or (i2i) the large
grid and an end token. ``ar2diffusion`` keeps the large grid and upsamples it x2 to the DiT's grid
(nearest); for image-to-image it does the same with the source images' VQ ids, which the AR stage computed
and returned as stage outputs: the one place GLM-Image's d32 grids become the DiT's d16 ones.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_omni_plugin.config.pipeline import ARTokenCount
from vllm_omni_plugin.models.glm_image_config import CODEBOOK_SIZE, SOURCE_GRIDS, SOURCE_TOKEN_IDS
from vllm_omni_plugin.stage.core_types import (
    StageDiffusionCoreRequest,
    StageLLMCoreOutput,
    StageLLMCoreRequest,
)
from vllm_omni_plugin.stage.errors import StageError
from vllm_omni_plugin.stage.input_processor import request_size

if TYPE_CHECKING:
    from vllm_omni_plugin.stage.orchestrator import ProcessorContext

FACTOR = 32
"""Pixels per large-grid AR token (the VQ grid is at 1/32 of the image)."""
PREVIEW_SIDE = 16
"""The t2i preview grid is about 16x16 tokens whatever the target size."""


def glm_image_grid(height: int, width: int) -> tuple[int, int, int, int]:
    """``(th, tw, ph, pw)``: the large grid and the t2i preview grid for an image of this size (the same
    arithmetic as ``GlmImageProcessor``)."""
    th = (height // FACTOR * FACTOR) // FACTOR
    tw = (width // FACTOR * FACTOR) // FACTOR
    if th < 1 or tw < 1:
        raise ValueError(f"GLM-Image needs height and width >= {FACTOR}, got {height}x{width}")
    ratio = th / tw
    return th, tw, int(math.sqrt(ratio) * PREVIEW_SIDE), int(math.sqrt(1 / ratio) * PREVIEW_SIDE)


def glm_image_max_new_tokens(height: int, width: int, image_to_image: bool = False) -> int:
    """AR tokens per image: t2i preview + large grid + end; i2i large grid + end."""
    return _generated_tokens(glm_image_grid(height, width), image_to_image)


def _generated_tokens(grid: tuple[int, int, int, int], image_to_image: bool) -> int:
    th, tw, ph, pw = grid
    return th * tw + 1 if image_to_image else th * tw + ph * pw + 1


def upsample_prior(ids: Any, grid_h: int, grid_w: int) -> np.ndarray:
    """Nearest x2 upsampling of a (grid_h x grid_w) id grid, flattened row-major (int64)."""
    grid = np.asarray(ids, dtype=np.int64).reshape(grid_h, grid_w)
    return grid.repeat(2, axis=0).repeat(2, axis=1).reshape(-1)


@functools.cache
def _processor(model: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(os.path.join(model, "processor"))


def _messages(images: Sequence[Any], prompt: str) -> list[dict[str, Any]]:
    """The one-turn conversation the processor's chat template renders: the source images, then the text."""
    content: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images]
    content.append({"type": "text", "text": prompt})
    return [{"role": "user", "content": content}]


@functools.cache
def _non_codebook_bias(model: str) -> dict[int, float]:
    """``logit_bias`` that rules out every id of the AR's LM head past the codebook (image start/end and
    unused rows; ids beyond the head are ``-inf`` already). Not ``allowed_token_ids``: vLLM's V2 model
    runner takes at most 1024 of those per request (``MAX_NUM_ALLOWED_TOKEN_IDS``) and fails the whole
    engine on more; it takes 1024 biases, and the head has 128 ids past the codebook."""
    import json

    with open(os.path.join(model, "vision_language_encoder", "config.json"), encoding="utf-8") as f:
        head = int(json.load(f)["text_config"]["vision_vocab_size"])
    return dict.fromkeys(range(CODEBOOK_SIZE, head), float("-inf"))


@functools.cache
def _special_tokens_added(model: str) -> int:
    return int(_processor(model).tokenizer.num_special_tokens_to_add())


def _text_tokens(model: str, prompt: str, images: int, grid: tuple[int, int, int, int], exact: bool) -> int:
    """The prompt's tokens besides the source images' (chat template, text, size scaffold), as
    ``request2ar`` builds them; ``exact=False``: an upper bound without tokenizing.

    The text is what ``GlmImageProcessor`` tokenizes: the rendered template with one ``<|image|>`` per
    source (each then counted as its image tokens), then ``<sop>th tw<eop>[<sop>ph pw<eop>]`` and the
    image start. The bound is its UTF-8 bytes: a byte-level BPE emits at most one token per byte, plus
    the special tokens the tokenizer adds itself."""
    processor = _processor(model)
    tokenizer = processor.tokenizer
    rendered = processor.apply_chat_template(_messages([None] * images, prompt), tokenize=False)
    th, tw, ph, pw = grid
    scaffold = f"{processor.grid_bos_token}{th} {tw}{processor.grid_eos_token}"
    if not images:
        scaffold += f"{processor.grid_bos_token}{ph} {pw}{processor.grid_eos_token}"
    text = f"{rendered}{scaffold}{processor.bos_token}"
    # As ProcessorMixin.apply_chat_template: no special tokens added to a template that starts with bos.
    add_special = not (tokenizer.bos_token is not None and rendered.startswith(tokenizer.bos_token))
    if exact:
        return len(tokenizer(text, add_special_tokens=add_special)["input_ids"]) - images
    placeholders = images * len(processor.image_token.encode("utf-8"))
    return len(text.encode("utf-8")) - placeholders + (_special_tokens_added(model) if add_special else 0)


def glm_image_source_tokens(model: str, width: int, height: int) -> int:
    """AR tokens of one source image: the image processor's own rule on the model's processor config
    (``smart_resize`` halves the image, clamps it to min/max pixels on the patch x merge grid, then one
    token per patch), the count the AR engine expands the image's placeholder to."""
    image_processor = _processor(model).image_processor
    return int(image_processor.get_number_of_image_patches(height, width, {}))


def glm_image_ar_tokens(
    model: str, prompt: str, image_sizes: Sequence[tuple[int, int]], width: int, height: int, limit: int
) -> ARTokenCount:
    """Every token a request holds in the AR stage (``Pipeline.ar_token_budget``): prompt text, source
    images (``image_sizes``: (width, height) each) and the generated grid of a ``width`` x ``height`` image.

    ``request2ar`` tokenizes the prompt anyway, so the text is bounded first and tokenized here only when
    that bound does not fit ``limit`` (the AR stage's ``max_model_len``): a count over the limit is exact.
    Raises ``ValueError`` for a source image the processor cannot take (aspect ratio over 4, too small).
    """
    sources: list[int] = []
    for i, (w, h) in enumerate(image_sizes):
        try:
            sources.append(glm_image_source_tokens(model, w, h))
        except ValueError as exc:
            raise ValueError(f"source image {i + 1} ({w}x{h}) cannot be used by GLM-Image: {exc}") from None
    images = len(sources)
    grid = glm_image_grid(height, width)
    generated = _generated_tokens(grid, image_to_image=bool(images))
    rest = sum(sources) + generated
    text = _text_tokens(model, prompt, images, grid, exact=False)
    if text + rest <= limit:
        return ARTokenCount(
            prompt_tokens=text, image_tokens=tuple(sources), generated_tokens=generated, exact=False
        )
    text = _text_tokens(model, prompt, images, grid, exact=True)
    room = limit - text - sum(sources)
    fit = None if text + rest <= limit else _largest_fit(room, width, height, bool(images))
    return ARTokenCount(
        prompt_tokens=text, image_tokens=tuple(sources), generated_tokens=generated, largest_fit=fit
    )


def _largest_fit(room: int, width: int, height: int, image_to_image: bool) -> tuple[int, int] | None:
    """The largest size of about this aspect ratio, on the 32-pixel grid, whose generated tokens fit in
    ``room``; None when not even the smallest does."""
    long_side, short_side = max(width, height), min(width, height)
    for side in range(long_side // FACTOR * FACTOR, FACTOR - 1, -FACTOR):
        other = max(FACTOR, round(side * short_side / long_side / FACTOR) * FACTOR)
        w, h = (side, other) if width >= height else (other, side)
        if glm_image_max_new_tokens(h, w, image_to_image) <= room:
            return w, h
    return None


def _as_pil(image: Any) -> Any:
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    return Image.fromarray(np.asarray(image, dtype=np.uint8)).convert("RGB")


def request2ar(sources: dict[int, Any], context: ProcessorContext) -> StageLLMCoreRequest:
    """The user's request (its size on the 32-pixel grid: the input processor checked it) -> the AR stage's
    prompt ids (with the size scaffold) and sampling."""
    request = context.request
    height, width = request_size(request, context.stage_id)
    images = [_as_pil(img) for img in request.images]
    inputs = _processor(context.model).apply_chat_template(
        _messages(images, request.prompt),
        tokenize=True,
        target_h=height,
        target_w=width,
        return_dict=True,
        return_tensors="pt",
    )
    prompt_ids = [int(t) for t in inputs["input_ids"][0].tolist()]
    n = glm_image_max_new_tokens(height, width, image_to_image=bool(images))
    sampling = {
        **request.sampling_params,
        "max_tokens": n,
        "min_tokens": n,
        "ignore_eos": True,
        "logit_bias": dict(_non_codebook_bias(context.model)),
        "detokenize": False,  # image tokens: no text to show, and detokenizing costs API-process CPU
    }
    if request.seed is not None and "seed" not in request.sampling_params:
        sampling["seed"] = request.seed
    return StageLLMCoreRequest(
        request_id=request.request_id,
        stage_id=context.stage_id,
        prompt_token_ids=prompt_ids,
        sampling_params=sampling,
        multi_modal_data={"image": images} if images else None,
    )


def ar2diffusion(sources: dict[int, Any], context: ProcessorContext) -> StageDiffusionCoreRequest:
    """AR output -> the DiT's request: the large grid upsampled x2, and the i2i sources' ids likewise."""
    from vllm_omni_plugin.families.glm_image.runner import GlmImageRequest

    request = context.request
    ar: StageLLMCoreOutput = sources[min(sources)]
    height, width = request_size(request, context.stage_id)
    grid = glm_image_grid(height, width)
    th, tw, ph, pw = grid
    image_to_image = bool(request.images)
    offset = 0 if image_to_image else ph * pw
    large = ar.token_ids[offset : offset + th * tw]
    if len(large) != th * tw:
        raise StageError(
            f"the AR stage returned {len(ar.token_ids)} tokens; a {height}x{width} image needs "
            f"{_generated_tokens(grid, image_to_image)}",
            stage_id=context.stage_id,
        )
    if max(large) >= CODEBOOK_SIZE or min(large) < 0:
        raise StageError("the AR stage returned ids outside the VQ codebook", stage_id=context.stage_id)
    import torch

    diffusion = request.runner_request(
        GlmImageRequest, prior_token_ids=torch.from_numpy(upsample_prior(large, th, tw))
    )
    if image_to_image:
        extra = ar.stage_outputs or {}
        ids, grids = extra.get(SOURCE_TOKEN_IDS), extra.get(SOURCE_GRIDS)
        if not ids or not grids or len(ids) != len(request.images):
            raise StageError(
                "the AR stage did not return the source images' prior tokens", stage_id=context.stage_id
            )
        diffusion.prior_token_image_ids = [
            torch.from_numpy(upsample_prior(i, h, w)) for i, (_, h, w) in zip(ids, grids, strict=True)
        ]
        diffusion.source_image_grid_thw = [[t, 2 * h, 2 * w] for t, h, w in grids]
        diffusion.images = [np.asarray(_as_pil(img)) for img in request.images]
    return StageDiffusionCoreRequest(
        request_id=request.request_id, stage_id=context.stage_id, diffusion=diffusion
    )
