"""Tiny random-weight models of real architectures, built offline.

``python -m vllm_omni_plugin.tiny_models KIND OUTDIR`` writes a model directory that vLLM,
transformers and diffusers load like the real thing. Builds are seeded and deterministic (the same
kind and config give byte-identical files) and cached by config hash: OUTDIR keeps a stamp with the
hash, and a second build with the same hash returns at once.

Every attention layer vLLM runs has head_dim 32, the smallest head size vLLM's CPU attention supports
(vLLM's Qwen2 derives head_dim as hidden_size / num_attention_heads).

Kinds: ``text`` (Qwen2 with a ChatML tokenizer), ``glm-image`` (the diffusers GLM-Image pipeline in the
upstream repository layout: AR model, processor, DiT, VAE, glyph T5, scheduler; 64x64 images in seconds),
``bagel`` (BAGEL-7B-MoT's hub layout: both MoT experts, NaViT SigLIP, FLUX autoencoder; see ``bagel``),
the single-stage diffusers pipelines ``sd3``, ``flux``, ``qwen-image`` and ``qwen-image-edit`` (the
real component classes of each family; see ``sd3``, ``flux``, ``qwen_image``), the Wan 2.1 video
pipelines ``wan`` (text-to-video) and ``wan-i2v`` (image-to-video) and Wan 2.2's two-expert text-to-video
``wan2.2`` (see ``wan``). ``sd3-medium-shape`` is not tiny: SD3 medium's DiT and VAE at their real shapes
(random, 4 GB), for measuring on a GPU. One module per family in this package, imported only when its kind
is built; their shared parts are in ``components``.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAMP_FILE = "tiny_model.json"
BUILDER_VERSION = 1


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """A family module's function, imported when first called; a build leaves the caller's global RNG as
    it was."""

    def call(*args: Any) -> Any:
        import torch

        function = getattr(importlib.import_module(f"vllm_omni_plugin.tiny_models.{module}"), name)
        if args:
            with torch.random.fork_rng(devices=[]):
                return function(*args)
        return function()

    return call


BUILDERS: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[Path, dict[str, Any]], None]]] = {
    "text": (_lazy("text", "text_config"), _lazy("text", "build_text")),
    "glm-image": (_lazy("glm_image", "glm_image_config"), _lazy("glm_image", "build_glm_image")),
    "bagel": (_lazy("bagel", "bagel_config"), _lazy("bagel", "build_bagel")),
    "sd3": (_lazy("sd3", "sd3_config"), _lazy("sd3", "build_sd3")),
    "sd3-medium-shape": (_lazy("sd3", "sd3_medium_shape_config"), _lazy("sd3", "build_sd3")),
    "flux": (_lazy("flux", "flux_config"), _lazy("flux", "build_flux")),
    "flux-fill": (_lazy("flux", "flux_fill_config"), _lazy("flux", "build_flux")),
    "qwen-image": (_lazy("qwen_image", "qwen_image_config"), _lazy("qwen_image", "build_qwen_image")),
    "qwen-image-edit": (
        _lazy("qwen_image", "qwen_image_edit_config"),
        _lazy("qwen_image", "build_qwen_image"),
    ),
    "wan": (_lazy("wan", "wan_config"), _lazy("wan", "build_wan")),
    "wan-i2v": (_lazy("wan", "wan_i2v_config"), _lazy("wan", "build_wan")),
    "wan2.2": (_lazy("wan", "wan22_config"), _lazy("wan", "build_wan")),
}


def config_hash(kind: str, cfg: dict[str, Any]) -> str:
    blob = json.dumps({"kind": kind, "builder": BUILDER_VERSION, "config": cfg}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def build(kind: str, outdir: str | Path) -> Path:
    """Build (or reuse) the tiny model ``kind`` in ``outdir``; returns the directory."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown tiny model kind {kind!r}; known: {', '.join(sorted(BUILDERS))}")
    make_config, builder = BUILDERS[kind]
    cfg = make_config()
    digest = config_hash(kind, cfg)
    out = Path(outdir)
    out.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time per directory: processes building the same model at once (parallel test
    # workers) would otherwise each replace the other's finished build, maybe while it is being read.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(kind, out, cfg, digest, builder)


def _build_locked(
    kind: str, out: Path, cfg: dict[str, Any], digest: str, builder: Callable[[Path, dict[str, Any]], None]
) -> Path:
    stamp = out / STAMP_FILE
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()).get("hash") == digest:
                return out
        except (OSError, ValueError):
            pass
    if out.exists() and any(out.iterdir()) and not stamp.is_file():
        raise FileExistsError(f"{out} exists and is not a tiny model directory; refusing to overwrite")
    # Build next to the target and swap in, so a crash never leaves a half-built cache hit.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        builder(tmp, cfg)
        (tmp / STAMP_FILE).write_text(
            json.dumps({"kind": kind, "hash": digest, "config": cfg}, indent=2, sort_keys=True)
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_omni_plugin.tiny_models",
        description="Build a tiny random-weight model of a real architecture, offline.",
    )
    parser.add_argument("kind", choices=sorted(BUILDERS))
    parser.add_argument("outdir")
    args = parser.parse_args(argv)
    try:
        out = build(args.kind, args.outdir)
    except (FileExistsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
