"""Tiny random LoRA adapters of a tiny model's denoiser, in diffusers' format (what
``save_lora_weights`` writes, and ``load_lora_weights`` reads: ``transformer.<module>.lora_A.weight`` and
``lora_B.weight``, no alpha: scaling 1), seeded, so a request with one gives a visibly different image."""

from __future__ import annotations

from pathlib import Path

TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
"""The attention projections every tiny DiT here has (SD3, FLUX, Qwen-Image: ``attn.``; GLM-Image:
``attn1.``)."""
FILE = "pytorch_lora_weights.safetensors"


def build_lora(model: str | Path, out: str | Path, seed: int, rank: int = 4, *, scale: float = 0.5) -> Path:
    """Write a LoRA of ``model``'s denoiser at ``out`` (a folder); returns the folder."""
    import torch
    from safetensors.torch import save_file

    from vllm_omni_plugin.diffusion.lora import denoiser_skeleton

    denoiser = denoiser_skeleton(str(model))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in denoiser.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(TARGETS):
            down = torch.randn((rank, module.in_features), generator=generator) / module.in_features**0.5
            up = torch.randn((module.out_features, rank), generator=generator) * scale
            tensors[f"transformer.{name}.lora_A.weight"] = down.contiguous()
            tensors[f"transformer.{name}.lora_B.weight"] = up.contiguous()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / FILE))
    return folder
