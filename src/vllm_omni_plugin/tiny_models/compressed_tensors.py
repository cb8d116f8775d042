"""A tiny model's AR stage as a compressed-tensors W8A8 int8 checkpoint (what llm-compressor writes for
``W8A8`` int8: each targeted linear weight int8 with a float32 scale per output row, activations quantized
per token at run time), so an AR stage serves it with vLLM's own int8 kernels (oneDNN on a CPU).

Only the language model's attention and MLP projections are quantized (``TARGETS``); embeddings, the
head, vision towers and everything else stay as they are, as the quantization recipes for these models
leave them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

TARGETS = r"re:.*language_model\..*layers\.\d+\.(self_attn|mlp)\.[a-z_]+_proj$"
"""The linear layers quantized (vLLM's module names, and the checkpoint's before fusing): every language
model layer's q/k/v/o and gate/up/down projections; not a generation expert's (``*_proj_moe_gen``), not
the vision tower's."""
WEIGHT_PATTERN = r".*language_model\..*layers\.\d+\.(self_attn|mlp)\.[a-z_]+_proj\.weight$"
"""The checkpoint's keys of those layers' weights."""


def quantization_config() -> dict[str, object]:
    """``config.json``'s ``quantization_config``: compressed-tensors, int8 weights per channel, int8
    activations per token, dynamic."""
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "ignore": [],
        "config_groups": {
            "group_0": {
                "targets": [TARGETS],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "channel",
                    "dynamic": False,
                    "group_size": None,
                    "observer": "minmax",
                },  # fmt: skip
                "input_activations": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                    "group_size": None,
                    "observer": None,
                },  # fmt: skip
                "output_activations": None,
            }
        },
    }


def write_w8a8_int8(source: str | Path, out: str | Path) -> Path:
    """Write the model folder ``source`` (a ``config.json`` and safetensors) quantized at ``out``; the
    other files copied as they are."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    source, out = Path(source), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pattern = re.compile(WEIGHT_PATTERN)
    scales: dict[str, str] = {}
    """Each scale written, with its weight's name."""
    for entry in source.iterdir():
        if entry.suffix == ".safetensors":
            written: dict[str, torch.Tensor] = {}
            for name, tensor in load_file(str(entry)).items():
                if pattern.match(name) and tensor.ndim == 2:
                    weight = tensor.to(torch.float32)
                    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
                    written[name] = torch.round(weight / scale).clamp(-128, 127).to(torch.int8)
                    written[f"{name}_scale"] = scale
                    scales[f"{name}_scale"] = name
                else:
                    written[name] = tensor
            save_file(written, str(out / entry.name), metadata={"format": "pt"})
        elif entry.name == "config.json":
            config = json.loads(entry.read_text())
            config["quantization_config"] = quantization_config()
            (out / "config.json").write_text(json.dumps(config, indent=2))
        elif entry.is_dir():
            shutil.copytree(entry, out / entry.name, dirs_exist_ok=True)
        elif entry.name != "model.safetensors.index.json":
            shutil.copy2(entry, out / entry.name)
    index_file = source / "model.safetensors.index.json"
    if index_file.is_file():  # each scale in its weight's file
        index = json.loads(index_file.read_text())
        weight_map = dict(index["weight_map"])
        weight_map.update(
            {scale: weight_map[weight] for scale, weight in scales.items() if weight in weight_map}
        )
        index["weight_map"] = weight_map
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def quantized_pipeline(model: str | Path, subdir: str, out: str | Path) -> Path:
    """A copy of the pipeline folder ``model`` whose ``subdir`` (its AR model) is quantized; the other
    parts are links to the originals."""
    model, out = Path(model), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for entry in model.iterdir():
        if entry.name != subdir and not (out / entry.name).exists():
            os.symlink(entry.resolve(), out / entry.name)
    write_w8a8_int8(model / subdir, out / subdir)
    return out
