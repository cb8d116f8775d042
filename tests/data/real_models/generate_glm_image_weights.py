"""Write ``glm_image_weights/*.json``: the tensor names and shapes of GLM-Image's weight files.

Each component is built on the meta device from its ``config.json`` in ``glm_image/`` with the class
``model_index.json`` names (transformers' ``GlmImageForConditionalGeneration`` and ``T5EncoderModel``,
diffusers' ``GlmImageTransformer2DModel`` and ``AutoencoderKL``); a weight file holds a class's state
dict without its tied copies (``save_pretrained`` drops them). Nothing is downloaded and no memory is
allocated for weights. Run from anywhere: ``python tests/data/real_models/generate_glm_image_weights.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
MODEL = HERE / "glm_image"
OUT = HERE / "glm_image_weights"
DTYPE = "BF16"
"""Recorded for the lists; the hub stores these components in bfloat16 (``torch_dtype`` of their configs)."""


def _config(component: str) -> dict[str, Any]:
    return json.loads((MODEL / component / "config.json").read_text())


def component_modules() -> dict[str, torch.nn.Module]:
    """Every weight-bearing component of the pipeline, on the meta device."""
    from diffusers import AutoencoderKL, GlmImageTransformer2DModel
    from transformers import GlmImageConfig, GlmImageForConditionalGeneration, T5Config, T5EncoderModel

    with torch.device("meta"):
        return {
            "vision_language_encoder": GlmImageForConditionalGeneration(
                GlmImageConfig(**_config("vision_language_encoder"))
            ),
            "text_encoder": T5EncoderModel(T5Config(**_config("text_encoder"))),
            "transformer": GlmImageTransformer2DModel.from_config(_config("transformer")),
            "vae": AutoencoderKL.from_config(_config("vae")),
        }


def weight_listing(module: torch.nn.Module) -> dict[str, list[int]]:
    """``{name: shape}`` of what ``save_pretrained`` writes: the state dict less tied copies."""
    tied = set((getattr(module, "all_tied_weights_keys", None) or {}).keys())
    return {
        name: list(value.shape) for name, value in sorted(module.state_dict().items()) if name not in tied
    }


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, module in component_modules().items():
        path = OUT / f"{name}.json"
        path.write_text(json.dumps({"dtype": DTYPE, "tensors": weight_listing(module)}, indent=1) + "\n")
        print(f"{path.name}: {len(weight_listing(module))} tensors")


if __name__ == "__main__":
    main()
