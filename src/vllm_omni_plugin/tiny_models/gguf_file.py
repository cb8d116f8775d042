"""A GGUF checkpoint of a tiny model's denoiser, as the single-file GGUF denoisers people share (ComfyUI's
``*-Q8_0.gguf``) are: each linear weight in GGUF blocks (``Q8_0``: 32 int8 values and a float16 scale),
the rest in float32, keyed by the diffusers state dict (which diffusers' ``from_single_file`` reads as it
is), for the stage's ``quantization: {denoiser: gguf}``."""

from __future__ import annotations

from pathlib import Path

QUANT_TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1")
"""Block types written (each of 32 values; diffusers dequantizes all of them)."""


def write_denoiser_gguf(model: str | Path, out: str | Path, quant_type: str = "Q8_0") -> Path:
    """Write ``model``'s transformer as a GGUF file at ``out``; returns its path."""
    import gguf
    import numpy as np
    import torch

    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be one of {', '.join(QUANT_TYPES)}, got {quant_type!r}")
    qtype = gguf.GGMLQuantizationType[quant_type]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    transformer = _transformer(Path(model), torch.float32)
    writer = gguf.GGUFWriter(str(out), arch=type(transformer).__name__)
    for name, tensor in transformer.state_dict().items():
        array = tensor.detach().to(torch.float32).numpy()
        if name.endswith(".weight") and array.ndim == 2 and array.shape[1] % block == 0:
            packed = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def _transformer(model: Path, dtype: object) -> object:
    import json

    import diffusers

    index = json.loads((model / "model_index.json").read_text())
    cls = getattr(diffusers, index["transformer"][1])
    return cls.from_pretrained(model, subfolder="transformer", torch_dtype=dtype)
