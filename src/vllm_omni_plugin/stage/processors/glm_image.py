"""GLM-Image's stage-input processors: the user's request -> the AR stage, AR output -> the DiT stage.

The AR stage (GLM-Image's vision_language_encoder in vLLM) must see the target size in its prompt: the
processor's chat template appends the grid scaffold ``<sop>th tw<eop>[<sop>ph pw<eop>]`` and the image
start token. It then emits (t2i) a preview grid, the large grid and an end token, or (i2i) the large
grid and an end token. ``ar2diffusion`` keeps the large grid, upsamples it x2 to the DiT's grid
(nearest), and for image-to-image passes the source images' prior tokens, which the AR stage computed
and returned as stage outputs.
"""

from __future__ import annotations

import functools
import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_omni_plugin.stage.core_types import (
    StageDiffusionCoreRequest,
    StageLLMCoreOutput,
    StageLLMCoreRequest,
)
from vllm_omni_plugin.stage.errors import StageError, StageRequestError

if TYPE_CHECKING:
    from vllm_omni_plugin.config.resolved import ResolvedDeployment
    from vllm_omni_plugin.stage.orchestrator import OmniRequest, ProcessorContext

FACTOR = 32
"""Pixels per large-grid AR token (the VQ grid is at 1/32 of the image)."""
PREVIEW_SIDE = 16
"""The t2i preview grid is about 16x16 tokens whatever the target size."""
CODEBOOK_SIZE = 16384
"""AR ids 0..16383 are VQ codebook ids, the only ones the DiT embeds."""


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
    th, tw, ph, pw = glm_image_grid(height, width)
    return th * tw + 1 if image_to_image else th * tw + ph * pw + 1


def upsample_prior(ids: Any, grid_h: int, grid_w: int) -> np.ndarray:
    """Nearest x2 upsampling of a (grid_h x grid_w) id grid, flattened row-major (int64)."""
    grid = np.asarray(ids, dtype=np.int64).reshape(grid_h, grid_w)
    return grid.repeat(2, axis=0).repeat(2, axis=1).reshape(-1)


@functools.cache
def _processor(model: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(os.path.join(model, "processor"))


def _size(request: OmniRequest, deployment: ResolvedDeployment) -> tuple[int, int]:
    """The request's size, else the DiT stage's resolved default (the pipeline's, unless configured)."""
    dit = next(s for s in deployment.stages if s.execution_type == "diffusion")
    return int(request.height or dit.diffusion_args["height"]), int(
        request.width or dit.diffusion_args["width"]
    )


def _as_pil(image: Any) -> Any:
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    return Image.fromarray(np.asarray(image, dtype=np.uint8)).convert("RGB")


def request2ar(sources: dict[int, Any], context: ProcessorContext) -> StageLLMCoreRequest:
    """The user's request -> the AR stage's prompt ids (with the size scaffold) and sampling."""
    request = context.request
    height, width = _size(request, context.deployment)
    try:
        glm_image_grid(height, width)
    except ValueError as exc:
        raise StageRequestError(str(exc), stage_id=context.stage_id) from None
    images = [_as_pil(img) for img in request.images]
    content: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images]
    content.append({"type": "text", "text": request.prompt})
    inputs = _processor(context.model).apply_chat_template(
        [{"role": "user", "content": content}],
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
        "allowed_token_ids": list(range(CODEBOOK_SIZE)),
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
    """AR output -> the DiT's request: the large grid upsampled x2, plus the i2i source tokens."""
    from vllm_omni_plugin.diffusion.params import DiffusionRequest

    request = context.request
    ar: StageLLMCoreOutput = sources[min(sources)]
    height, width = _size(request, context.deployment)
    th, tw, ph, pw = glm_image_grid(height, width)
    image_to_image = bool(request.images)
    offset = 0 if image_to_image else ph * pw
    large = ar.token_ids[offset : offset + th * tw]
    if len(large) != th * tw:
        raise StageError(
            f"the AR stage returned {len(ar.token_ids)} tokens; a {height}x{width} image needs "
            f"{glm_image_max_new_tokens(height, width, image_to_image)}",
            stage_id=context.stage_id,
        )
    if max(large) >= CODEBOOK_SIZE or min(large) < 0:
        raise StageError("the AR stage returned ids outside the VQ codebook", stage_id=context.stage_id)
    import torch

    diffusion = DiffusionRequest(
        request_id=request.request_id,
        prompt=request.prompt,
        height=height,
        width=width,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        seed=request.seed,
        negative_prompt=request.negative_prompt,
        prior_token_ids=torch.from_numpy(upsample_prior(large, th, tw)),
        return_latents=request.return_latents,
    )
    if image_to_image:
        extra = ar.stage_outputs or {}
        ids, grids = extra.get("prior_token_image_ids"), extra.get("source_image_grid_thw")
        if not ids or not grids or len(ids) != len(request.images):
            raise StageError(
                "the AR stage did not return the source images' prior tokens", stage_id=context.stage_id
            )
        diffusion.prior_token_image_ids = [torch.tensor(i, dtype=torch.long) for i in ids]
        diffusion.source_image_grid_thw = [list(g) for g in grids]
        diffusion.images = [np.asarray(_as_pil(img)) for img in request.images]
    return StageDiffusionCoreRequest(
        request_id=request.request_id, stage_id=context.stage_id, diffusion=diffusion
    )
