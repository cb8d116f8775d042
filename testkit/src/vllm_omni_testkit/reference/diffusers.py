"""Direct diffusers calls: what a request to a single-stage diffusion deployment must reproduce.

Each helper loads the stock pipeline with ``from_pretrained`` and calls it the way a diffusers user would,
one request at a time, returning the PIL image diffusers makes, as a uint8 array. Nothing of our runners
is used, so tests and benchmarks compare the served images against an independent spelling of the
documented request -> pipeline mapping:

- ``guidance_scale`` is the pipeline's ``guidance_scale``, except Qwen-Image's families, where it is
  ``true_cfg_scale`` with ``negative_prompt=" "`` when the request gives none (guidance above 1 only);
- a source image is the pipeline's ``image`` (Qwen-Image-Edit-2509 and later: the list of a request's
  images); where the model's own pipeline takes none, diffusers' image-to-image pipeline of the family
  (``AutoPipelineForImage2Image.from_pipe``) makes it, and a request with a mask is diffusers'
  inpainting pipeline's (``AutoPipelineForInpainting.from_pipe``, or the model's own where it is one, as
  FLUX.1 Fill's: the mask its ``mask_image``, white where repainted), with the request's ``strength``
  where it gives one.

The only thing taken from this project is the Qwen-Image-Edit processor loader, which transformers needs
torchvision for (see ``vllm_omni_plugin.families.diffusers.qwen2vl_processor``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

QWEN_CFG_PIPELINES = ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline")


def pipeline_class(model_dir: str | Path) -> str:
    return str(json.loads((Path(model_dir) / "model_index.json").read_text())["_class_name"])


TORCHAO_CONFIGS = {
    "int8_weight_only": "Int8WeightOnlyConfig",
    "int8_dynamic": "Int8DynamicActivationInt8WeightConfig",
    "float8_weight_only": "Float8WeightOnlyConfig",
}
"""The torchao config class of each scheme a quantized reference is made with."""


@functools.lru_cache(maxsize=4)
def load_reference_pipeline(model_dir: str, quantized: str | None = None) -> Any:
    """The stock pipeline of ``model_dir`` in float32 on the CPU (cached: a test module asks often).
    ``quantized``: its transformer quantized as a diffusers user does it, a torchao scheme
    (:data:`TORCHAO_CONFIGS`) through ``PipelineQuantizationConfig``, or ``gguf:PATH``: the transformer
    read from that GGUF file with ``from_single_file``."""
    import diffusers
    import torch

    name = pipeline_class(model_dir)
    extra: dict[str, Any] = {}
    if (Path(model_dir) / "processor").is_dir() and name.startswith("QwenImageEdit"):
        from vllm_omni_plugin.families.diffusers.qwen2vl_processor import load_qwen2vl_processor

        extra["processor"] = load_qwen2vl_processor(Path(model_dir) / "processor")
    if quantized is not None and quantized.startswith("gguf:"):
        index = json.loads((Path(model_dir) / "model_index.json").read_text())
        transformer_cls = getattr(diffusers, index["transformer"][1])
        extra["transformer"] = transformer_cls.from_single_file(
            quantized.removeprefix("gguf:"),
            quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32),
            config=model_dir,
            subfolder="transformer",
            torch_dtype=torch.float32,
        )
    elif quantized is not None:
        import torchao.quantization

        config = getattr(torchao.quantization, TORCHAO_CONFIGS[quantized])()
        extra["quantization_config"] = diffusers.PipelineQuantizationConfig(
            quant_mapping={"transformer": diffusers.TorchAoConfig(config)}
        )
    pipe = getattr(diffusers, name).from_pretrained(model_dir, dtype=torch.float32, **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_image(
    model_dir: str | Path,
    *,
    prompt: str,
    seed: int,
    height: int | None,
    width: int | None,
    steps: int,
    guidance: float,
    negative_prompt: str | None = None,
    images: list[Any] | None = None,
    lora: tuple[str, str, float] | None = None,
    mask: Any | None = None,
    strength: float | None = None,
    quantized: str | None = None,
) -> Any:
    """One stock diffusers call for one request; the image as a uint8 HxWx3 array (``None`` sizes: the
    pipeline's own default). ``lora`` (name, path, scale): the adapter loaded with diffusers' own
    ``load_lora_weights`` (PEFT) and set to that scale, as a diffusers user runs one. ``quantized``: the
    pipeline with its transformer quantized (:func:`load_reference_pipeline`)."""
    import inspect

    import diffusers
    import numpy as np
    import torch
    from PIL import Image

    name = pipeline_class(model_dir)
    pipe = load_reference_pipeline(str(model_dir), quantized)
    kwargs: dict[str, Any] = {
        "prompt": prompt,
        "height": height,
        "width": width,
        "num_inference_steps": steps,
        "generator": torch.Generator("cpu").manual_seed(seed),
    }
    if name in QWEN_CFG_PIPELINES:
        kwargs["true_cfg_scale"] = guidance
        if guidance > 1:
            kwargs["negative_prompt"] = negative_prompt or " "
    else:
        kwargs["guidance_scale"] = guidance
        if negative_prompt is not None:
            kwargs["negative_prompt"] = negative_prompt
    if images:
        pil = [Image.fromarray(np.asarray(i)) if not isinstance(i, Image.Image) else i for i in images]
        kwargs["image"] = pil if name == "QwenImageEditPlusPipeline" else pil[0]
    if lora is None:
        if pipe.get_list_adapters():
            pipe.disable_lora()
    else:
        name_, path, scale = lora
        if name_ not in {a for adapters in pipe.get_list_adapters().values() for a in adapters}:
            pipe.load_lora_weights(path, adapter_name=name_)
        pipe.enable_lora()
        pipe.set_adapters([name_], [scale])
    takes = inspect.signature(type(pipe).__call__).parameters
    if mask is not None:
        kwargs["mask_image"] = Image.fromarray(np.asarray(mask, dtype=np.uint8))
        if "mask_image" not in takes:  # FLUX.1 Fill's own pipeline takes it
            pipe = diffusers.AutoPipelineForInpainting.from_pipe(pipe)
    elif images and "image" not in takes:
        pipe = diffusers.AutoPipelineForImage2Image.from_pipe(pipe)
    if strength is not None:
        kwargs["strength"] = strength
    out = pipe(**kwargs)
    return np.asarray(out.images[0].convert("RGB"))
