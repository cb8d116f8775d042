"""Reference GLM-Image runs for tests: transformers' AR for the prior tokens, stock diffusers for the DiT.

Our DiT stage takes prior tokens computed elsewhere (the AR stage). These helpers compute the same inputs
with the upstream libraries only, so tests can compare our stage against an independent reference.

diffusers 0.42.1's own image-to-image path fails with transformers 5.19 inside ``generate_prior_tokens``:
it concatenates the per-image vision features into one tensor, while transformers' ``get_image_tokens``
iterates over a list of ``(C, h, w)`` features (``expected input[1, 1, 2, 2] to have 32 channels``). Here
the features are passed as a list (``get_image_tokens(list(features))``); diffusers is not patched.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

DEFAULT_STEPS = 4
DEFAULT_GUIDANCE = 1.5


@functools.lru_cache(maxsize=2)
def _load_ar(model_dir: str, dtype_name: str) -> tuple[Any, Any]:
    """The AR model and its processor, cached: a test module asks for several references."""
    import torch
    from transformers import GlmImageForConditionalGeneration, GlmImageProcessor

    processor = GlmImageProcessor.from_pretrained(Path(model_dir) / "processor")
    ar = GlmImageForConditionalGeneration.from_pretrained(
        Path(model_dir) / "vision_language_encoder", dtype=getattr(torch, dtype_name)
    )
    return processor, ar.eval()


@functools.lru_cache(maxsize=2)
def _load_dit(model_dir: str, dtype_name: str) -> Any:
    """The stock DiT-only pipeline (no AR encoder, no processor), cached."""
    import torch
    from diffusers import GlmImagePipeline

    return GlmImagePipeline.from_pretrained(
        model_dir, vision_language_encoder=None, processor=None, dtype=getattr(torch, dtype_name)
    )


def _upsample(ids: Any, grid_h: int, grid_w: int) -> Any:
    """Nearest x2 upsampling of a d32 id grid to the DiT's d16 grid, flattened (as diffusers does)."""
    import torch

    grid = ids.reshape(1, 1, grid_h, grid_w).float()
    return torch.nn.functional.interpolate(grid, scale_factor=2, mode="nearest").long().reshape(-1)


def glm_image_reference_prior_tokens(
    model_dir: str | Path,
    prompt: str,
    height: int,
    width: int,
    images: list[Any] | None = None,
    seed: int = 0,
    *,
    dtype: str = "float32",
) -> dict[str, Any]:
    """What GLM-Image's DiT needs from the AR model, computed with transformers (greedy decoding).

    Returns ``prior_token_ids`` (1-D int64, the upsampled large grid, ``(H/16)*(W/16)`` ids),
    ``generated`` (the AR's raw new tokens) and, for image-to-image (``images`` given, PIL images),
    ``prior_token_image_ids`` (one upsampled 1-D id tensor per source image) and
    ``source_image_grid_thw`` (one ``[t, 2h, 2w]`` list per source image), else ``None`` for both; and
    ``top_logits`` (``[generated, 2]`` float32): at each generated token, its logit and the runner-up's, which
    say how far another implementation's rounding may move the logits before greedy decoding picks another
    token.
    """
    import torch

    from vllm_omni_plugin.families.glm_image.processors import glm_image_grid

    processor, ar = _load_ar(str(model_dir), dtype)
    image_to_image = bool(images)
    content: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images or []]
    content.append({"type": "text", "text": prompt})
    inputs = processor.apply_chat_template(
        [[{"role": "user", "content": content}]],
        tokenize=True,
        target_h=height,
        target_w=width,
        return_dict=True,
        return_tensors="pt",
    )
    th, tw, ph, pw = glm_image_grid(height, width)

    prior_token_image_ids: list[Any] | None = None
    source_image_grid_thw: list[list[int]] | None = None
    with torch.no_grad():
        if image_to_image:
            source_grids = inputs["image_grid_thw"][: len(images or [])]
            features = ar.get_image_features(inputs["pixel_values"], source_grids).pooler_output
            # The workaround: a list of per-image (C, h, w) features, which is what transformers iterates.
            ids_d32 = ar.get_image_tokens(list(features), source_grids)
            prior_token_image_ids, source_image_grid_thw = [], []
            for ids, (t, h, w) in zip(
                torch.split(ids_d32, source_grids.prod(-1).tolist()), source_grids.tolist(), strict=True
            ):
                prior_token_image_ids.append(_upsample(ids, h, w))
                source_image_grid_thw.append([t, 2 * h, 2 * w])

        torch.manual_seed(seed)  # greedy needs no RNG; seeded anyway, as the pipeline seeds before generate
        max_new_tokens = th * tw + 1 if image_to_image else th * tw + ph * pw + 1
        out = ar.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    generated = out.sequences[0, inputs["input_ids"].shape[1] :]
    top_logits = torch.stack([scores[0].float().topk(2).values for scores in out.scores])
    offset = 0 if image_to_image else ph * pw
    large = generated[offset : offset + th * tw]
    if large.numel() != th * tw:
        raise RuntimeError(f"the AR stopped early: {generated.numel()} tokens, expected {max_new_tokens}")
    return {
        "prior_token_ids": _upsample(large, th, tw),
        "prior_token_image_ids": prior_token_image_ids,
        "source_image_grid_thw": source_image_grid_thw,
        "generated": generated,
        "top_logits": top_logits,
    }


def glm_image_reference_image(
    model_dir: str | Path,
    prompt: str,
    height: int,
    width: int,
    images: list[Any] | None = None,
    seed: int = 0,
    *,
    num_inference_steps: int = DEFAULT_STEPS,
    guidance_scale: float = DEFAULT_GUIDANCE,
    prior: dict[str, Any] | None = None,
    dtype: str = "float32",
    output_type: str = "pil",
) -> Any:
    """The stock DiT-only ``GlmImagePipeline`` run on reference prior tokens; a uint8 HxWx3 array.

    ``prior`` (from :func:`glm_image_reference_prior_tokens`) is computed when not given. With
    ``output_type="np"`` the pipeline's float image in [0, 1] is returned instead.
    """
    import numpy as np
    import torch

    if prior is None:
        prior = glm_image_reference_prior_tokens(model_dir, prompt, height, width, images, seed, dtype=dtype)
    pipe = _load_dit(str(model_dir), dtype)
    kwargs: dict[str, Any] = {}
    if prior["prior_token_image_ids"] is not None:
        kwargs = {
            "image": list(images or []),
            "prior_token_image_ids": [torch.cat(prior["prior_token_image_ids"])],
            "source_image_grid_thw": [torch.tensor(prior["source_image_grid_thw"], dtype=torch.long)],
        }
    out = pipe(
        prompt,
        height=height,
        width=width,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        prior_token_ids=prior["prior_token_ids"].reshape(1, -1),
        generator=torch.Generator().manual_seed(seed),
        output_type=output_type,
        **kwargs,
    ).images[0]
    return np.asarray(out) if output_type == "pil" else out
