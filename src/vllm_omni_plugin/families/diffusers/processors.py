"""The single-stage ``diffusion`` pipeline's processor: the user's request -> the diffusion stage's request.

Unset fields stay unset: the diffusion engine fills them from the stage's configured defaults, else the
pipeline's own (``__call__`` defaults), in one place. Source images travel as uint8 HxWx3 arrays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_omni_plugin.stage.core_types import StageDiffusionCoreRequest

if TYPE_CHECKING:
    from vllm_omni_plugin.stage.orchestrator import ProcessorContext


def _as_array(image: Any) -> np.ndarray:
    from PIL import Image

    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8))


def request2diffusion(sources: dict[int, Any], context: ProcessorContext) -> StageDiffusionCoreRequest:
    from vllm_omni_plugin.diffusion.params import DiffusionRequest

    request = context.request
    diffusion = DiffusionRequest(
        request_id=request.request_id,
        prompt=request.prompt,
        height=request.height,
        width=request.width,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        seed=request.seed,
        negative_prompt=request.negative_prompt,
        images=[_as_array(image) for image in request.images] or None,
        return_latents=request.return_latents,
    )
    return StageDiffusionCoreRequest(
        request_id=request.request_id, stage_id=context.stage_id, diffusion=diffusion
    )
