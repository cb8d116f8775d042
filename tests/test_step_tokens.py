"""Batch sizes follow the work, not a fixed count: each runner says how many latent tokens a denoising
step of a request carries (its image's tokens times its guidance branches), and batches (or the groups in
flight, ``batching: step``) are bounded by their sum, ``max_step_tokens``: small images batch by the
dozen, a large one runs alone. ``max_batch_size`` still pins a count where the deploy file sets it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_omni_plugin.config import PLATFORMS, resolve_deployment
from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionRequest
from vllm_omni_plugin.diffusion.engine import MAX_STEP_TOKENS
from vllm_omni_plugin.diffusion.engine_config import DiffusionEngineConfig
from vllm_omni_plugin.diffusion.runner import MAX_BATCH_SIZE
from vllm_omni_plugin.families.bagel.request import BagelContext, BagelGenerationRequest, BagelSampling
from vllm_omni_plugin.families.bagel.runner import BagelGenerationRunner

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def ask(request_id: str, size: int = 64, guidance: float = 4.0) -> DiffusionRequest:
    return DiffusionRequest(request_id=request_id, prompt="a red fox", height=size, width=size, seed=0,
                            num_inference_steps=2, guidance_scale=guidance)  # fmt: skip


@pytest.fixture(scope="module")
def sd3(tiny_sd3: Path) -> DiffusionEngine:
    return DiffusionEngine(tiny_sd3, DiffusionEngineConfig(max_step_tokens=64))


def test_each_family_counts_the_tokens_a_step_carries(
    sd3: DiffusionEngine, tiny_flux: Path, tiny_glm_image: Path, tiny_bagel: Path
) -> None:
    # SD3: 8x8 latents in 2x2 patches, 16 tokens; guidance runs a second row of them
    assert sd3.runner.step_tokens(ask("g")) == 32
    assert sd3.runner.step_tokens(ask("u", guidance=1.0)) == 16
    assert sd3.runner.step_tokens(ask("l", size=128)) == 128
    unsized = DiffusionRequest(
        request_id="n", prompt="a red fox", guidance_scale=4.0
    )  # the pipeline draws one
    assert sd3.runner.step_tokens(unsized) == 2  # no size known: one token a row
    # FLUX embeds its guidance: one row whatever the scale
    flux = DiffusionEngine(tiny_flux).runner
    assert flux.step_tokens(ask("f")) == flux.step_tokens(ask("f", guidance=1.0)) == 16
    # GLM-Image: its second (unconditional) pass is a second call of the same tokens
    glm = DiffusionEngine(tiny_glm_image).runner
    from test_diffusion_memory import glm_request

    request = glm_request("g", 64)  # with its default guidance, 1.5
    assert glm.step_tokens(request) == 2 * (64 // glm.memory_shape.patch_pixels) ** 2
    # BAGEL: its image block once per row it adds (cond; cfg_text; cfg_img where it runs and differs)
    import torch

    bagel = BagelGenerationRunner.load(str(tiny_bagel), dtype=torch.float32, device="cpu")
    block = (64 // bagel.cfg.latent_downsample) ** 2

    def bagel_request(**sampling: Any) -> BagelGenerationRequest:
        context = BagelContext(kv_len=5, rope=5)
        other = BagelContext(kv_len=4, rope=4)
        return BagelGenerationRequest(request_id="b", cond=context, cfg_text=other, cfg_img=other, height=64,
                                      width=64, sampling=BagelSampling(**sampling))  # fmt: skip

    assert bagel.step_tokens(bagel_request(cfg_text_scale=1.0)) == block
    assert bagel.step_tokens(bagel_request(cfg_text_scale=4.0, cfg_img_scale=1.0)) == 2 * block
    assert bagel.step_tokens(bagel_request(cfg_text_scale=4.0, cfg_img_scale=2.0)) == 3 * block


def test_batches_keep_to_max_step_tokens_and_a_large_request_runs_alone(sd3: DiffusionEngine) -> None:
    assert sd3.max_batch_size == MAX_BATCH_SIZE and sd3.max_step_tokens == 64
    guided = [ask(f"g{i}") for i in range(5)]  # 32 tokens each: two per batch
    assert sd3.plan(guided)[0] == [[0, 1], [2, 3], [4]]
    unguided = [ask(f"u{i}", guidance=1.0) for i in range(5)]  # 16 each: four per batch
    assert sd3.plan(unguided)[0] == [[0, 1, 2, 3], [4]]
    large = [ask("l0", size=128), ask("l1", size=128)]  # 128 tokens each, more than the budget: alone
    batches, failed = sd3.plan(large)
    assert not failed and batches == [[0], [1]]


def test_a_pinned_max_batch_size_still_caps_the_count(tiny_sd3: Path, sd3: DiffusionEngine) -> None:
    pinned = DiffusionEngine(tiny_sd3, DiffusionEngineConfig(max_batch_size=3), runner=sd3.runner)
    assert pinned.max_step_tokens == MAX_STEP_TOKENS["cpu"] == 1024
    assert pinned.plan([ask(f"u{i}", guidance=1.0) for i in range(5)])[0] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="max_step_tokens must be >= 1"):
        DiffusionEngine(tiny_sd3, DiffusionEngineConfig(max_step_tokens=-1), runner=sd3.runner)


def test_resolution_hands_the_token_budget_to_the_stage(tiny_sd3: Path, tmp_path: Path) -> None:
    unpinned = resolve_deployment(str(tiny_sd3), platform=PLATFORMS["cpu"]).stage(0).diffusion_args
    assert unpinned["max_batch_size"] == MAX_BATCH_SIZE and "max_step_tokens" not in unpinned
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        "pipeline: diffusion\nstages:\n  - {stage_id: 0, max_step_tokens: 512, max_batch_size: 4}\n"
    )
    pinned = resolve_deployment(str(tiny_sd3), deploy_config=str(deploy), platform=PLATFORMS["cpu"])
    args = pinned.stage(0).diffusion_args
    assert args["max_step_tokens"] == 512 and args["max_batch_size"] == 4
    deploy.write_text("pipeline: diffusion\nstages:\n  - {stage_id: 0, max_step_tokens: 0}\n")
    from vllm_omni_plugin.config import ConfigError

    with pytest.raises(ConfigError, match="max_step_tokens"):
        resolve_deployment(str(tiny_sd3), deploy_config=str(deploy), platform=PLATFORMS["cpu"])
