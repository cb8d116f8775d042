"""The single-stage ``diffusion`` pipeline's processor: the user's request (complete: the input processor
gave it its defaults) -> the diffusion stage's request. Source images travel as uint8 HxWx3 arrays.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_omni_plugin.stage.core_types import StageDiffusionCoreRequest
from vllm_omni_plugin.stage.errors import StageRequestError

if TYPE_CHECKING:
    from vllm_omni_plugin.stage.orchestrator import ProcessorContext


def _as_array(image: Any) -> np.ndarray:
    from PIL import Image

    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8))


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str, subfolder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, subfolder=subfolder)


def check_prompt_tokens(context: ProcessorContext) -> None:
    """Refuse a prompt (or negative prompt) longer than the model's text encoder takes where its pipeline
    encodes prompts whole (``ModelFacts.prompt_token_limit``): in the diffusion stage it would pad every
    prompt of its batch to that length before failing. Pipelines that truncate take any prompt."""
    from vllm_omni_plugin.diffusion.diffusers_registry import inspect_model

    facts = inspect_model(context.model)
    limit = facts.prompt_token_limit
    request = context.request
    if limit is None:
        return
    tokenizer = _tokenizer(context.model, facts.prompt_tokenizer)
    for field, text in (("prompt", request.prompt), ("negative_prompt", request.negative_prompt)):
        if not text:
            continue
        count = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if count > limit:
            raise StageRequestError(
                f"{field} is {count} tokens; this model ({facts.pipeline_class}) encodes at most {limit} "
                "prompt tokens: send a shorter one",
                stage_id=context.stage_id,
                request_id=request.request_id,
            )


def request2diffusion(sources: dict[int, Any], context: ProcessorContext) -> StageDiffusionCoreRequest:
    from vllm_omni_plugin.diffusion.params import DiffusionRequest

    check_prompt_tokens(context)
    request = context.request
    diffusion = request.runner_request(
        DiffusionRequest, images=[_as_array(image) for image in request.images] or None
    )
    return StageDiffusionCoreRequest(
        request_id=request.request_id, stage_id=context.stage_id, diffusion=diffusion
    )
