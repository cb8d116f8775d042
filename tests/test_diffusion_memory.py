"""A diffusion stage keeps to its memory budget (``gpu_memory_utilization``): batches are formed within
what the budget leaves after the weights, by the runner's activation estimate, and a request that cannot
fit even alone fails as a bad request (HTTP 400) naming its size and the budget, instead of running out
of memory. On CPU the budget is a share of the machine's memory (there is no device to cap); these tests
size it from the machine they run on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from vllm_omni_plugin.config import PLATFORMS, resolve_deployment
from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, DiffusionRequest
from vllm_omni_plugin.diffusion.diffusers_registry import load_pipeline_runner
from vllm_omni_plugin.diffusion.memory import RESERVE_BYTES, MemoryBudget, tensor_bytes
from vllm_omni_plugin.entrypoints.omni_server import http_status
from vllm_omni_plugin.families.bagel.request import BagelContext, BagelGenerationRequest, BagelSampling
from vllm_omni_plugin.families.bagel.runner import BagelGenerationRunner
from vllm_omni_plugin.families.glm_image.runner import GlmImageRequest

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

STEPS = 2
CODEBOOK = 16384


def fraction_leaving(weights: int, activations: int) -> float:
    """The ``gpu_memory_utilization`` whose budget, on this machine, leaves ``activations`` bytes for a
    batch once ``weights`` and the reserve are taken (budgets this small keep the minimum reserve)."""
    fraction = (weights + RESERVE_BYTES + activations + 1) / psutil.virtual_memory().total
    budget = MemoryBudget(fraction, "cpu", psutil.virtual_memory().total, weights)
    assert abs(budget.activation_bytes - activations) <= 2, budget
    return fraction


def glm_request(request_id: str, size: int, seed: int = 0) -> GlmImageRequest:
    import torch

    side = size // 16
    prior = torch.randint(0, CODEBOOK, (side * side,), generator=torch.Generator().manual_seed(seed))
    return GlmImageRequest(request_id=request_id, prompt="a red fox", height=size, width=size, seed=seed,
                            num_inference_steps=STEPS, guidance_scale=1.5,  # GLM-Image's default, as served
                            prior_token_ids=prior)  # fmt: skip


@pytest.fixture(scope="module")
def glm_runner(tiny_glm_image: Path) -> Any:
    import torch

    return load_pipeline_runner(str(tiny_glm_image), dtype=torch.float32, device="cpu")


def test_batches_keep_to_the_budget_and_a_request_too_large_alone_is_refused(
    tiny_glm_image: Path, glm_runner: Any
) -> None:
    sizes = {n: glm_runner.activation_bytes([glm_request(str(i), 64) for i in range(n)]) for n in (1, 2, 3)}
    assert sizes[1] < sizes[2] < sizes[3]  # the estimate grows with the batch
    big = glm_runner.activation_bytes([glm_request("big", 512)])
    room = (sizes[2] + sizes[3]) // 2  # two 64x64 requests fit a batch, three do not
    assert big > room
    weights = tensor_bytes(glm_runner.weight_tensors())
    fraction = fraction_leaving(weights, room)
    engine = DiffusionEngine(tiny_glm_image, DiffusionEngineConfig(dtype="float32", max_batch_size=8, gpu_memory_utilization=fraction,
                             vae_tiling="never"), runner=glm_runner)  # fmt: skip
    assert engine.memory is not None and engine.memory.weight_bytes == weights

    requests = [glm_request(f"r{i}", 64, seed=i) for i in range(5)] + [glm_request("big", 512)]
    batches, failed = engine.plan(requests)
    assert batches == [[0, 1], [2, 3], [4]]  # max_batch_size 8 allows more; the budget does not
    assert list(failed) == [5] and failed[5].invalid
    message = failed[5].error
    assert "512x512" in message and f"gpu_memory_utilization {fraction:g}" in message
    assert "GiB" in message and "smaller image" in message

    results = engine.generate(requests)
    assert [r.batch_size for r in results[:5]] == [2, 2, 2, 2, 1] and all(r.ok for r in results[:5])
    assert results[5].invalid and results[5].error == message

    unbounded = DiffusionEngine(
        tiny_glm_image, DiffusionEngineConfig(dtype="float32", max_batch_size=8), runner=glm_runner
    )
    assert unbounded.plan(requests)[0] == [[0, 1, 2, 3, 4], [5]]  # without a budget: batches by size only


def test_a_budget_the_weights_fill_fails_at_start(tiny_glm_image: Path, glm_runner: Any) -> None:
    weights = tensor_bytes(glm_runner.weight_tensors())
    fraction = (weights + RESERVE_BYTES // 2) / psutil.virtual_memory().total
    with pytest.raises(ValueError, match="holds its weights and nothing more.*raise gpu_memory_utilization"):
        DiffusionEngine(
            tiny_glm_image,
            DiffusionEngineConfig(dtype="float32", gpu_memory_utilization=fraction),
            runner=glm_runner,
        )


def test_a_request_too_large_for_the_budget_is_a_400_through_the_stage(
    tiny_sd3: Path, tmp_path: Path
) -> None:
    """The one-stage diffusion pipeline, its stage in this process: the refusal reaches the caller as a
    bad request, and requests that fit are served."""
    import torch

    from vllm_omni_plugin.entrypoints.omni import Omni
    from vllm_omni_plugin.stage.orchestrator import OmniRequest

    runner = load_pipeline_runner(str(tiny_sd3), dtype=torch.float32, device="cpu")

    def sd3(size: int) -> DiffusionRequest:
        return DiffusionRequest(request_id="x", prompt="a fox", height=size, width=size, guidance_scale=2.0,
                                num_inference_steps=STEPS)  # fmt: skip

    room = (runner.activation_bytes([sd3(64)]) + runner.activation_bytes([sd3(1024)])) // 2
    fraction = fraction_leaving(tensor_bytes(runner.weight_tensors()), room)
    deploy = tmp_path / "budget.yaml"
    deploy.write_text(
        "pipeline: diffusion\nstages:\n  - stage_id: 0\n    process: false\n"
        f"    gpu_memory_utilization: {fraction!r}\n    vae_tiling: never\n"
    )
    with Omni(str(tiny_sd3), deploy_config=str(deploy)) as omni:
        assert omni.deployment.stage(0).diffusion_args["gpu_memory_utilization"] == fraction
        small, large = omni.generate(
            [
                OmniRequest(
                    prompt="a fox", height=s, width=s, seed=0, num_inference_steps=STEPS, guidance_scale=2.0
                )
                for s in (64, 1024)
            ]  # fmt: skip
        )
    assert small.ok, small.error
    assert not large.ok and http_status(large.exception) == 400
    assert "1024x1024" in large.error and "gpu_memory_utilization" in large.error


def test_the_vae_decodes_image_by_image_then_in_tiles_where_the_budget_needs_it(tiny_sd3: Path) -> None:
    """``vae_tiling: auto``: a batch whose whole decode would not fit the budget decodes image by image
    (the images it gives whole, within a level), and an image whose decode alone would not fit decodes
    in tiles, where ``never`` refuses it. Tiles change the image (each tile's decoder sees only its
    tile): on this tiny random VAE (64-pixel tiles, 16 blended, attention in its middle block) a 128x128
    image moves 24/255 on average; the documentation states it."""
    import numpy as np
    import torch

    runner = load_pipeline_runner(str(tiny_sd3), dtype=torch.float32, device="cpu")

    def sd3(request_id: str, size: int) -> DiffusionRequest:
        return DiffusionRequest(request_id=request_id, prompt=f"a fox {request_id}", height=size, width=size,
                                guidance_scale=2.0, num_inference_steps=STEPS, seed=len(request_id))  # fmt: skip

    pair = [sd3("a", 128), sd3("bb", 128)]
    denoise = runner.activation_phases(pair)["denoise"]
    whole, sliced, tiled = (runner.decode_bytes(2, 128, 128, p) for p in ("whole", "sliced", "tiled"))
    assert tiled < sliced < whole
    weights = tensor_bytes(runner.weight_tensors())
    results, plans = {}, {}
    for mode, room in (("slice", max(denoise, sliced) + 1), ("tile", max(denoise, tiled) + 1)):
        assert room < (whole if mode == "slice" else sliced)
        config = DiffusionEngineConfig(dtype="float32", max_batch_size=2, batching="request",
                                       gpu_memory_utilization=fraction_leaving(weights, room))  # fmt: skip
        engine = DiffusionEngine(tiny_sd3, config, runner=runner)
        plans[mode] = runner.decode_plan(2, 128, 128)
        results[mode] = engine.generate(pair)
        never = DiffusionEngine(tiny_sd3, msgspec.structs.replace(config, vae_tiling="never"), runner=runner)
        refused = never.generate([sd3("a", 128)])[0] if mode == "tile" else None
    assert plans == {"slice": "sliced", "tile": "tiled"}
    unbounded = DiffusionEngine(tiny_sd3, DiffusionEngineConfig(dtype="float32", max_batch_size=2,
                                batching="request"), runner=runner)  # fmt: skip
    wholly = unbounded.generate(pair)
    assert all(r.ok and r.batch_size == 2 for r in (*results["slice"], *results["tile"], *wholly))
    for by_image, at_once, in_tiles in zip(results["slice"], wholly, results["tile"], strict=True):
        a, b, c = (np.asarray(r.image).astype(np.int16) for r in (by_image, at_once, in_tiles))
        assert np.abs(a - b).max() <= 1
        assert np.abs(c - b).mean() > 1  # tiled: the decoder saw tiles
    assert refused is not None and refused.invalid and "128x128" in (refused.error or "")


def test_a_videos_frames_count_in_its_memory_budget_and_decode_plan(tiny_wan: Path) -> None:
    """A video's estimate grows with its frames: a 48x64 frame is 3x4 = 12 tokens per latent frame (8x
    spatial, patch 2), 9 frames are 3 latent frames (4x temporal, the first its own), 17 are 5, twice the
    rows with guidance. Its decode plan (``vae_tiling: auto``) is ``whole`` without a budget, ``sliced``
    for two videos where the budget holds them one after the other (each chunk's decoder beside both
    videos' frames) but not at once, ``tiled`` where it holds neither. ``vae_tiling: always`` decodes with the VAE's tiling on, which for frames smaller than its
    tile (256 pixels) decodes them whole: the same frames."""
    import numpy as np
    import torch

    runner = load_pipeline_runner(str(tiny_wan), dtype=torch.float32, device=torch.device("cpu"))

    def video(frames: int, guidance: float = 3.0) -> DiffusionRequest:
        return DiffusionRequest(request_id="v", prompt="a fox", height=48, width=64, seed=0, num_frames=frames,
                                num_inference_steps=STEPS, guidance_scale=guidance)  # fmt: skip

    assert runner.frame_step == 4 and runner.memory_shape.patch_pixels == 16
    assert [runner.step_tokens(video(f, guidance=1.0)) for f in (1, 5, 9, 17)] == [12, 24, 36, 60]
    assert [runner.step_tokens(video(f)) for f in (9, 17)] == [72, 120]  # guidance: two rows each
    assert runner.activation_bytes([video(17)]) > runner.activation_bytes([video(9)])
    longer, shorter = runner.activation_phases([video(17)]), runner.activation_phases([video(9)])
    assert longer["denoise"] > shorter["denoise"] and longer["decode"] > shorter["decode"]

    runner.context.vae_tiling = "auto"  # as the engine sets it, with the budget its memory leaves
    one, two = (runner.decode_bytes(n, 48, 64, "whole", 9) for n in (1, 2))
    in_turn = runner.decode_bytes(2, 48, 64, "sliced", 9)
    assert one < in_turn < two
    plans = {}
    for budget in (None, two, in_turn, one - 1):
        runner.context.decode_budget = budget
        plans[budget] = (runner.decode_plan(1, 48, 64, 9), runner.decode_plan(2, 48, 64, 9))
    assert plans == {
        None: ("whole", "whole"),
        two: ("whole", "whole"),
        in_turn: ("whole", "sliced"),
        one - 1: ("tiled", "tiled"),
    }
    runner.context.decode_budget = None

    vae = runner.pipe.vae
    decode, seen = vae._decode, []

    def flags_seen(*args: Any, **kwargs: Any) -> Any:
        seen.append((vae.use_slicing, vae.use_tiling))
        return decode(*args, **kwargs)

    vae._decode = flags_seen
    try:
        made = {}
        for tiling in ("auto", "always"):
            runner.context.vae_tiling = tiling
            (made[tiling],) = runner.run([video(9)], [torch.Generator().manual_seed(0)]).images
    finally:
        runner.context.vae_tiling = "auto"
        del vae._decode
    assert seen == [(False, False), (True, True)]  # whole, then tiled (slicing on too)
    assert (vae.use_slicing, vae.use_tiling) == (False, False)  # set for each decode alone
    assert made["always"].shape == (9, 48, 64, 3) and made["always"].dtype == np.uint8
    np.testing.assert_array_equal(made["always"], made["auto"])  # one 256-pixel tile covers 48x64
    assert made["always"].std() > 10


def test_resolution_hands_the_budget_to_the_diffusion_stage(tiny_glm_image: Path, tmp_path: Path) -> None:
    deploy = tmp_path / "shared.yaml"
    deploy.write_text(
        "pipeline: glm_image\nstages:\n"
        "  - {stage_id: 0, devices: '0', gpu_memory_utilization: 0.5}\n"
        "  - {stage_id: 1, devices: '0', gpu_memory_utilization: 0.4}\n"
    )
    for platform in ("cuda", "cpu"):
        resolved = resolve_deployment(
            str(tiny_glm_image), deploy_config=str(deploy), platform=PLATFORMS[platform]
        )
        assert resolved.stage(0).engine_args["gpu_memory_utilization"] == 0.5
        assert resolved.stage(1).diffusion_args["gpu_memory_utilization"] == 0.4
        notes = [n for n in resolved.notes if "gpu_memory_utilization" in n]
        if platform == "cuda":
            assert notes == []
        else:  # what the field means without a GPU, said once, at its line
            (note,) = notes
            assert "shared.yaml:4" in note and "share of the machine's memory" in note


def test_bagel_estimate_follows_size_contexts_and_guidance(tiny_bagel: Path) -> None:
    """BAGEL's DiT keeps every row's context K/V for the whole batch: the estimate grows with the image,
    the contexts' lengths and the guidance branches that run, and counts a branch shared with cond once."""
    import torch

    runner = BagelGenerationRunner.load(str(tiny_bagel), dtype=torch.float32, device="cpu")

    def request(size: int, cond: int, text: int | None = 0, img: BagelContext | None = None, **sampling: Any):
        cond_ctx = BagelContext(kv_len=cond, rope=cond)
        text_ctx = None if text is None else BagelContext(kv_len=text, rope=text)
        return BagelGenerationRequest(request_id="r", cond=cond_ctx, cfg_text=text_ctx, cfg_img=img, height=size,
                                      width=size, sampling=BagelSampling(**sampling))  # fmt: skip

    estimate = runner.activation_bytes
    long = 40_000  # tokens: the tiny model's contexts outweigh its decoder only when they are this long
    base = estimate([request(64, long)])
    assert estimate([request(64, long)]) > estimate([request(64, 64)])  # the decoder's share, at least
    assert estimate([request(128, long)]) > base
    assert estimate([request(64, 2 * long)]) > base
    assert estimate([request(64, long)] * 2) > base
    assert estimate([request(64, long, text=None, cfg_text_scale=1.0)]) < base  # one row, not two
    same_as_cond = BagelContext(kv_len=long, rope=long, prefix_of="cond")
    other = BagelContext(kv_len=long - 10, rope=long - 10)
    edit = {"cfg_img_scale": 2.0, "cfg_interval": (0.0, 1.0)}
    assert estimate([request(64, long, img=same_as_cond, **edit)]) < estimate(
        [request(64, long, img=other, **edit)]
    )
    assert runner.describe_request(request(64, 100)) == "a 64x64 image over contexts of 100, 0 tokens"
    assert tensor_bytes(runner.weight_tensors()) > 0


def test_a_long_prompt_is_not_padded_into_a_batch_of_short_ones_past_the_budget(
    tiny_qwen_image: Path,
) -> None:
    """Qwen-Image pads a call's prompts to its longest: the estimate counts that padding (and the text
    encoder's kept hidden states), so the budget keeps a long prompt out of a batch of short ones it
    would swell past the budget."""
    import torch

    runner = load_pipeline_runner(str(tiny_qwen_image), dtype=torch.float32, device="cpu")

    def request(request_id: str, prompt: str) -> DiffusionRequest:
        return DiffusionRequest(request_id=request_id, prompt=prompt, height=64, width=64, seed=0,
                                num_inference_steps=STEPS, guidance_scale=1.0)  # fmt: skip

    short = [request(f"s{i}", f"a red fox {i}") for i in range(4)]
    long = request("long", " ".join(["painted"] * 900))
    assert runner.prompt_length(long) > 900 > runner.prompt_length(short[0])
    four_short = runner.activation_bytes(short)
    with_long = runner.activation_bytes([*short[:3], long])
    assert with_long > 3 * four_short  # every row padded to the long prompt
    phases = runner.activation_phases([*short[:3], long])
    assert phases["encode_prompt"] > runner.activation_phases(short)["encode_prompt"]

    fraction = fraction_leaving(tensor_bytes(runner.weight_tensors()), (four_short + with_long) // 2)
    engine = DiffusionEngine(tiny_qwen_image, DiffusionEngineConfig(dtype="float32", max_batch_size=8, gpu_memory_utilization=fraction), runner=runner)  # fmt: skip
    batches, failed = engine.plan([*short, long])
    assert not failed and batches == [[0, 1, 2, 3], [4]]  # the long one alone: four short ones fit


@pytest.mark.parametrize("budget", ["memory", "max_step_tokens"])
def test_step_batched_groups_in_flight_keep_to_the_budget_together(
    tiny_glm_image: Path, glm_runner: Any, budget: str
) -> None:
    """With ``batching: step`` the groups in flight share each step's forwards, so their activations and
    their latent tokens add up: of two groups admitted at once (two requests, and one more, where two fit
    the budget and three do not), the second starts once the first is done."""
    import threading

    from test_previews import LoopReport
    from vllm_omni_plugin.stage.core_types import StageDiffusionCoreRequest
    from vllm_omni_plugin.stage.diffusion_loop import DiffusionBatchLoop

    limits: dict[str, Any] = {}
    if budget == "memory":
        sizes = {
            n: glm_runner.activation_bytes([glm_request(str(i), 64) for i in range(n)]) for n in (1, 2, 3)
        }
        room = (sizes[2] + sizes[3]) // 2
        limits["gpu_memory_utilization"] = fraction_leaving(tensor_bytes(glm_runner.weight_tensors()), room)
    else:
        limits["max_step_tokens"] = 2 * glm_runner.step_tokens(glm_request("r", 64))
    engine = DiffusionEngine(tiny_glm_image, DiffusionEngineConfig(dtype="float32", max_batch_size=8, batching="step", batch_wait_ms=60_000,
                                                                    vae_tiling="never", **limits), runner=glm_runner)  # fmt: skip
    in_flight: list[int] = []

    class CountingLoop(DiffusionBatchLoop):
        def _hold_at_step(self, step: int = 0) -> None:  # the groups' step callback: how many run now
            in_flight.append(sum(t.name == "dit-group" for t in threading.enumerate()))

    report = LoopReport()
    loop = CountingLoop(engine, 1, report, max_batch=8)
    requests = [glm_request(f"r{i}", 64, seed=i) for i in range(3)]
    requests = [msgspec.structs.replace(r, prior_token_ids=r.prior_token_ids.tolist()) for r in requests]
    for request in requests:  # all queued before the loop takes any: admitted at once, as two groups
        loop.inbox.add(StageDiffusionCoreRequest(request_id=request.request_id, stage_id=1,
                                                 diffusion=msgspec.to_builtins(request)))  # fmt: skip
    serving = threading.Thread(target=loop.serve, name="dit-loop", daemon=True)
    serving.start()
    try:
        with report.changed:
            assert report.changed.wait_for(lambda: len(report.outputs_by_id) == 3, 120)
    finally:
        loop.inbox.drain()
        serving.join(120)
    assert all(o.error is None for o in report.outputs_by_id.values())
    assert in_flight == [1] * (2 * STEPS)  # never both at once
