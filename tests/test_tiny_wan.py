"""The tiny Wan video models (``wan``, ``wan-i2v``, Wan 2.2's two-expert ``wan2.2``): built deterministically,
small, of the real classes, and run by diffusers' own pipelines into videos that are neither constant nor
clipped, vary from frame to frame and from seed to seed, and repeat exactly for a seed."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm_omni_plugin import tiny_models as tiny

pytestmark = pytest.mark.slow

SHAPE = (1, 9, 48, 64, 3)
COMPONENTS = {
    "tokenizer": "T5Tokenizer",
    "text_encoder": "UMT5EncoderModel",
    "transformer": "WanTransformer3DModel",
    "vae": "AutoencoderKLWan",
    "scheduler": "UniPCMultistepScheduler",
}
KINDS = {
    "wan": ("WanPipeline", COMPONENTS),
    "wan-i2v": (
        "WanImageToVideoPipeline",
        {**COMPONENTS, "image_encoder": "CLIPVisionModel", "image_processor": "CLIPImageProcessor"},
    ),
    "wan2.2": ("WanPipeline", {**COMPONENTS, "transformer_2": "WanTransformer3DModel"}),
}


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def no_ftfy_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' image-to-video pipeline cleans prompts with ftfy without checking it is installed (the
    text-to-video one checks): stand in for it where it is not."""
    from diffusers.pipelines.wan import pipeline_wan_i2v

    if not hasattr(pipeline_wan_i2v, "ftfy"):
        monkeypatch.setattr(pipeline_wan_i2v, "ftfy", types.SimpleNamespace(fix_text=str), raising=False)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_build_is_deterministic_small_and_of_the_real_classes(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cached = request.getfixturevalue(f"tiny_{kind.replace('-', '_').replace('.', '')}")
    assert _tree(tiny.build(kind, tmp_path / kind)) == _tree(cached)  # byte for byte, weights included
    assert sum(len(blob) for blob in _tree(cached).values()) < 8 * 1024 * 1024
    pipeline, components = KINDS[kind]
    index = json.loads((cached / "model_index.json").read_text())
    assert index["_class_name"] == pipeline
    assert {name: index[name][1] for name in components} == components
    assert index.get("boundary_ratio") == (0.875 if kind == "wan2.2" else None)  # Wan2.2-T2V-A14B's
    vae = json.loads((cached / "vae" / "config.json").read_text())
    assert (vae["scale_factor_spatial"], vae["scale_factor_temporal"], vae["z_dim"]) == (8, 4, 16)
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == 16
    transformer = json.loads((cached / "transformer" / "config.json").read_text())
    assert transformer["in_channels"] == (36 if kind == "wan-i2v" else 16)
    scheduler = json.loads((cached / "scheduler" / "scheduler_config.json").read_text())
    assert (scheduler["prediction_type"], scheduler["use_flow_sigmas"], scheduler["flow_shift"]) == (
        "flow_prediction",
        True,
        3.0,
    )


def _videos(pipe: Any, seeds: tuple[int, ...], **kwargs: Any) -> list[np.ndarray]:
    import torch

    pipe.set_progress_bar_config(disable=True)
    return [
        pipe(
            prompt="a red fox in the snow",
            height=48,
            width=64,
            num_frames=9,
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
            **kwargs,
        ).frames
        for seed in seeds
    ]


def _check(videos: list[np.ndarray]) -> None:
    first, again, other = videos
    for video in videos:
        assert video.shape == SHAPE and video.dtype == np.float32
        assert 0.0 <= video.min() and video.max() <= 1.0
        assert video.std() > 0.05  # not constant after the VAE
        assert ((video <= 0.0) | (video >= 1.0)).mean() < 0.5  # not mostly clipped
        assert np.abs(np.diff(video[0], axis=0)).mean() > 0.01  # frames differ
    np.testing.assert_array_equal(first, again)
    assert np.abs(first - other).mean() > 0.01


def test_text_to_video_runs_in_diffusers_own_pipeline(tiny_wan: Path) -> None:
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    pipe = WanPipeline.from_pretrained(tiny_wan)
    assert isinstance(pipe.transformer, WanTransformer3DModel) and isinstance(pipe.vae, AutoencoderKLWan)
    _check(_videos(pipe, (0, 0, 1)))


def test_two_expert_text_to_video_runs_in_diffusers_own_pipeline(tiny_wan22: Path) -> None:
    """Wan 2.2 A14B's layout: ``transformer_2`` of the same architecture and its own weights, and two steps
    (timesteps 999 and 750) that fall one on each side of the boundary (875), so both experts run."""
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel

    pipe = WanPipeline.from_pretrained(tiny_wan22)
    assert isinstance(pipe.transformer_2, WanTransformer3DModel)
    assert (pipe.config.boundary_ratio, pipe.config.expand_timesteps) == (0.875, False)
    configs = [
        json.loads((tiny_wan22 / name / "config.json").read_text())
        for name in ("transformer", "transformer_2")
    ]
    assert configs[0] == configs[1]  # the same architecture
    high, low = dict(pipe.transformer.named_parameters()), dict(pipe.transformer_2.named_parameters())
    assert high.keys() == low.keys() and not any(torch.equal(high[k], low[k]) for k in high)
    pipe.scheduler.set_timesteps(2)
    assert [int(t) for t in pipe.scheduler.timesteps] == [999, 750]
    _check(_videos(pipe, (0, 0, 1)))


def test_image_to_video_runs_in_diffusers_own_pipeline(tiny_wan_i2v: Path, no_ftfy_needed: None) -> None:
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanTransformer3DModel
    from PIL import Image
    from transformers import CLIPVisionModel

    pipe = WanImageToVideoPipeline.from_pretrained(tiny_wan_i2v)
    assert isinstance(pipe.transformer, WanTransformer3DModel) and isinstance(pipe.vae, AutoencoderKLWan)
    assert isinstance(pipe.image_encoder, CLIPVisionModel)
    pixels = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    videos = _videos(pipe, (0, 0, 1), image=Image.fromarray(pixels))
    _check(videos)
    gray = _videos(pipe, (0,), image=Image.fromarray(np.full_like(pixels, 128)))[0]
    assert np.abs(gray - videos[0]).mean() > 0.01  # the source image conditions the video
