"""The diffusion stage on the tiny GLM-Image: equal to the stock diffusers DiT, batching that keeps each
request's image, per-request failures, and the pipeline registry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

import helpers
from vllm_omni_plugin.config import PLATFORMS
from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, DiffusionResult
from vllm_omni_plugin.diffusion import diffusers_registry as registry
from vllm_omni_plugin.diffusion.diffusers_runner import DiffusersPipelineRunner
from vllm_omni_plugin.diffusion.worker import CPUDiffusionWorker, CUDADiffusionWorker
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.families.glm_image.runner import GlmImageRequest, GlmImageRunner
from vllm_omni_testkit.reference.glm_image import (
    glm_image_reference_image,
    glm_image_reference_prior_tokens,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PROMPT = "A photo of a cat"
STEPS = 4
GUIDANCE = 1.5
"""GLM-Image's default guidance, which a served request carries (the input processor gives it)."""
CODEBOOK = 16384


@pytest.fixture(scope="module")
def engine(tiny_glm_image: Path) -> DiffusionEngine:
    return DiffusionEngine(tiny_glm_image, DiffusionEngineConfig(dtype="float32", max_batch_size=4))


@pytest.fixture(scope="module")
def source_image() -> np.ndarray:
    return helpers.source_image()


def random_prior(size: int, seed: int) -> Any:
    """Valid prior ids for a ``size`` x ``size`` image: the DiT does not care where they came from."""
    import torch

    side = size // 16
    return torch.randint(0, CODEBOOK, (side * side,), generator=torch.Generator().manual_seed(seed))


def t2i(request_id: str, prompt: str = PROMPT, size: int = 64, seed: int = 0, **kw: Any) -> GlmImageRequest:
    kw.setdefault("prior_token_ids", random_prior(size, seed))
    kw = {"num_inference_steps": STEPS, "guidance_scale": GUIDANCE, **kw}
    return GlmImageRequest(request_id=request_id, prompt=prompt, height=size, width=size, seed=seed, **kw)


def alone(engine: DiffusionEngine, request: GlmImageRequest) -> DiffusionResult:
    [result] = engine.generate([request])
    assert result.ok, result.error
    assert result.batch_size == 1
    return result


def assert_close(a: np.ndarray, b: np.ndarray) -> None:
    """Batched vs alone: equal up to batch-size dependent kernel rounding (<= 1/255, a few pixels)."""
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    assert diff.max() <= 1, diff.max()
    assert (diff > 0).mean() < 0.01


# --- equality with the stock pipeline ------------------------------------------------------------------


@pytest.mark.parametrize(("size", "steps"), [(64, 4), (128, 8)])
def test_t2i_equals_stock_dit_pipeline(
    engine: DiffusionEngine, tiny_glm_image: Path, size: int, steps: int
) -> None:
    prior = glm_image_reference_prior_tokens(tiny_glm_image, PROMPT, size, size, seed=42)
    assert prior["prior_token_ids"].shape == ((size // 16) ** 2,)
    assert prior["prior_token_image_ids"] is None
    expected = glm_image_reference_image(
        tiny_glm_image, PROMPT, size, size, seed=42, num_inference_steps=steps, prior=prior
    )
    request = GlmImageRequest(
        request_id=f"t2i-{size}",
        prompt=PROMPT,
        height=size,
        width=size,
        num_inference_steps=steps,
        guidance_scale=GUIDANCE,
        seed=42,
        prior_token_ids=prior["prior_token_ids"],
        return_latents=True,
    )
    result = alone(engine, request)
    assert result.image.dtype == np.uint8 and result.image.shape == (size, size, 3)
    np.testing.assert_array_equal(result.image, expected)
    assert tuple(result.latents.shape) == (16, size // 8, size // 8)
    assert set(result.timings) == {"encode", "denoise", "decode", "total"}
    assert 0 < result.timings["encode"] < result.timings["denoise"] < result.timings["total"]


def test_i2i_equals_stock_dit_pipeline(
    engine: DiffusionEngine, tiny_glm_image: Path, source_image: np.ndarray
) -> None:
    from PIL import Image

    pil = Image.fromarray(source_image)
    prior = glm_image_reference_prior_tokens(tiny_glm_image, "make it red", 64, 64, images=[pil], seed=3)
    assert prior["source_image_grid_thw"] == [[1, 4, 4]]  # 64 px -> processor halves -> d32 2x2 -> x2
    assert [ids.shape for ids in prior["prior_token_image_ids"]] == [(16,)]
    expected = glm_image_reference_image(
        tiny_glm_image, "make it red", 64, 64, images=[pil], seed=3, prior=prior
    )
    request = GlmImageRequest(
        request_id="i2i",
        prompt="make it red",
        height=64,
        width=64,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        seed=3,
        prior_token_ids=prior["prior_token_ids"],
        images=[source_image],  # a uint8 array here, PIL in the reference
        prior_token_image_ids=prior["prior_token_image_ids"],
        source_image_grid_thw=prior["source_image_grid_thw"],
    )
    np.testing.assert_array_equal(alone(engine, request).image, expected)
    # The source image matters: the same request without it is a different image.
    assert not np.array_equal(
        alone(engine, t2i("t2i", "make it red", seed=3, prior_token_ids=prior["prior_token_ids"])).image,
        expected,
    )


# --- batching ------------------------------------------------------------------------------------------


def test_compatible_requests_batch_and_match_alone(engine: DiffusionEngine) -> None:
    requests = [
        t2i("a", "A photo of a cat", seed=1),
        t2i("b", "A dog", seed=2),
        t2i("c", "a red fox", seed=3),
    ]
    batched = engine.generate(requests)
    assert [r.request_id for r in batched] == ["a", "b", "c"]
    assert [r.batch_size for r in batched] == [3, 3, 3]
    singles = [alone(engine, r) for r in requests]
    for b, s in zip(batched, singles, strict=True):
        assert b.seed == s.seed
        assert_close(b.image, s.image)
    assert not np.array_equal(singles[0].image, singles[1].image)


def test_batch_invariant_engine_is_bit_exact(engine: DiffusionEngine, tiny_glm_image: Path) -> None:
    exact = DiffusionEngine(
        tiny_glm_image, DiffusionEngineConfig(max_batch_size=4, batch_invariant=True), runner=engine.runner
    )
    requests = [t2i(str(i), seed=i) for i in range(3)]
    results = exact.generate(requests)
    assert [r.batch_size for r in results] == [1, 1, 1]
    for result, request in zip(results, requests, strict=True):
        np.testing.assert_array_equal(result.image, alone(engine, request).image)


def test_incompatible_requests_go_to_separate_batches(
    engine: DiffusionEngine, source_image: np.ndarray
) -> None:
    i2i_extras = {
        "images": [source_image],
        "prior_token_image_ids": [random_prior(64, 9)],
        "source_image_grid_thw": [[1, 4, 4]],
    }
    requests = [
        t2i("64a", seed=1),
        t2i("128", size=128, seed=2),
        t2i("64b", seed=3),
        t2i("steps", seed=4, num_inference_steps=2),
        t2i("guidance", seed=5, guidance_scale=1.0),
        t2i("glyph", "a 'sign' here", seed=6),  # a longer glyph sequence
        t2i("i2i", seed=7, **i2i_extras),
        t2i("64c", seed=8),
    ]
    batches, failed = engine.plan([engine._resolve(r) for r in requests])
    assert not failed
    assert batches == [[0, 2, 7], [1], [3], [4], [5], [6]]
    results = engine.generate(requests)
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    assert [r.batch_size for r in results] == [3, 1, 3, 1, 1, 1, 1, 3]
    assert results[1].image.shape == (128, 128, 3)
    for request, result in zip(requests, results, strict=True):
        assert result.ok, result.error
        assert_close(result.image, alone(engine, request).image)


def test_max_batch_size_splits_a_group(engine: DiffusionEngine) -> None:
    results = engine.generate([t2i(str(i), seed=i) for i in range(6)])
    assert [r.batch_size for r in results] == [4, 4, 4, 4, 2, 2]


def test_stock_pipeline_pads_glyph_embeddings_unmasked(engine: DiffusionEngine) -> None:
    """Why the glyph length is part of the batch key: diffusers left-pads the shorter glyph embeddings
    with zeros and the DiT attends to them, so a mixed batch changes the shorter prompt's image."""
    import torch

    pipe = engine.runner.pipe
    prompts = ["A photo of a cat", "a 'sign' here"]
    assert [engine.runner.glyph_length(p) for p in prompts] == [1, 5]
    priors = torch.stack([random_prior(64, 1), random_prior(64, 2)])

    def run(indices: list[int]) -> np.ndarray:
        return pipe(
            [prompts[i] for i in indices],
            height=64,
            width=64,
            num_inference_steps=STEPS,
            prior_token_ids=priors[indices],
            generator=[torch.Generator().manual_seed(10 + i) for i in indices],
            output_type="np",
        ).images

    mixed, single = run([0, 1])[0], run([0])[0]
    assert np.abs(mixed - single).max() > 0.01


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        "A cat",
        "a 'sign' here",
        "'a' and \"bc\" and \u201cx\u201d",
        "\u300c\u4e2d\u6587\u300d 'b'",
        "'' x",
    ],
)
def test_glyph_length_matches_the_pipeline(engine: DiffusionEngine, prompt: str) -> None:
    assert engine.runner.glyph_length(prompt) == engine.runner.pipe._get_glyph_embeds([prompt]).shape[1]


# --- failures ------------------------------------------------------------------------------------------


def test_bad_prior_tokens_fail_alone(engine: DiffusionEngine) -> None:
    import torch

    good = [t2i("ok1", seed=1), t2i("ok2", seed=2)]
    short = t2i("short", seed=3, prior_token_ids=random_prior(64, 3)[:10])
    out_of_range = t2i("range", seed=4, prior_token_ids=torch.full((16,), CODEBOOK))
    missing = t2i("missing", seed=5, prior_token_ids=None)
    results = engine.generate([good[0], short, out_of_range, missing, good[1]])
    ok1, bad_len, bad_range, bad_missing, ok2 = results
    assert bad_len.error is not None and bad_len.image is None
    assert "prior_token_ids has shape (10,)" in bad_len.error and "needs 16 ids" in bad_len.error
    assert "16384" in bad_range.error and "codebook" in bad_range.error
    assert "needs prior_token_ids" in bad_missing.error
    assert ok1.ok and ok2.ok and ok1.batch_size == ok2.batch_size == 2
    np.testing.assert_array_equal(ok1.image, engine.generate([good[0], good[1]])[0].image)


def test_a_failure_inside_the_pipeline_call_only_fails_its_request(
    engine: DiffusionEngine, source_image: np.ndarray
) -> None:
    def i2i(request_id: str, image: Any, seed: int) -> GlmImageRequest:
        extras = {"prior_token_image_ids": [random_prior(64, seed)], "source_image_grid_thw": [[1, 4, 4]]}
        return t2i(request_id, seed=seed, images=[image], **extras)

    float_image = source_image.astype(np.float32)  # passes validation (64x64), rejected when converted
    results = engine.generate([i2i("good", source_image, 1), i2i("bad", float_image, 2)])
    good, bad = results
    assert good.ok and good.batch_size == 1  # retried alone after the batch failed
    assert bad.error is not None and "uint8 HxWx3" in bad.error
    np.testing.assert_array_equal(good.image, alone(engine, i2i("good", source_image, 1)).image)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"height": 48}, "multiples of 32"),
        ({"negative_prompt": "blurry"}, "GlmImagePipeline takes no negative prompt"),
        ({"prior_token_ids": np.zeros(16, dtype=np.float32)}, "integer token ids"),
        ({"images": [np.zeros((64, 64, 3), np.uint8)]}, "together"),
        ({"source_image_grid_thw": [[1, 4, 4]]}, "together"),
        (
            {
                "images": [np.zeros((32, 32, 3), np.uint8)],
                "prior_token_image_ids": [random_prior(64, 1)],
                "source_image_grid_thw": [[1, 4, 4]],
            },
            "source image 0 is 32x32 pixels",
        ),
    ],
)
def test_invalid_requests_name_the_problem(
    engine: DiffusionEngine, change: dict[str, Any], message: str
) -> None:
    request = msgspec.structs.replace(t2i("bad", seed=1), **change)
    [result] = engine.generate([request])
    assert result.error is not None and message in result.error, result.error


# --- requests ------------------------------------------------------------------------------------------


def test_list_prior_and_json_round_trip(engine: DiffusionEngine) -> None:
    request = t2i("tensor", seed=7)
    as_list = msgspec.structs.replace(request, prior_token_ids=request.prior_token_ids.tolist())
    wire = msgspec.json.decode(msgspec.json.encode(as_list), type=GlmImageRequest)
    assert wire == as_list
    np.testing.assert_array_equal(alone(engine, wire).image, alone(engine, request).image)


def test_unseeded_requests_report_their_seed(engine: DiffusionEngine) -> None:
    first = alone(engine, msgspec.structs.replace(t2i("x"), seed=None))
    assert isinstance(first.seed, int)
    again = alone(engine, msgspec.structs.replace(t2i("x"), seed=first.seed))
    np.testing.assert_array_equal(first.image, again.image)


def test_the_engine_fills_no_default(engine: DiffusionEngine) -> None:
    """Requests arrive complete (the input processor's work): one without a size is refused, and a stage
    built from a resolved deploy config's ``diffusion_args`` holds no request default."""
    request = GlmImageRequest(request_id="d", prompt=PROMPT, seed=1, prior_token_ids=random_prior(64, 1))
    [result] = engine.generate([request])
    assert "multiples of 32" in result.error  # no size, and nobody here gives one
    # What a resolved deploy config's diffusion_args hold (tiny_glm_image_cpu.yaml's stage 1).
    diffusion_args = {"dtype": "float32", "max_batch_size": 4, "seed": 0}
    staged = DiffusionEngine(
        engine.model, DiffusionEngineConfig.from_args(diffusion_args), runner=engine.runner
    )
    assert staged.max_batch_size == 4
    np.testing.assert_array_equal(
        alone(staged, t2i("d", seed=1)).image, alone(engine, t2i("d", seed=1)).image
    )


# --- registry and workers ------------------------------------------------------------------------------


def test_unknown_pipeline_class_lists_registered_ones(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "NoSuchPipeline"}))
    with pytest.raises(
        registry.UnknownPipelineError,
        match="no pipeline class 'NoSuchPipeline'.*registered: GlmImagePipeline",
    ):
        DiffusionEngine(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        DiffusionEngine(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="neither a local directory nor"):
        DiffusionEngine("no-such-org/no-such-model")  # offline, not in the hub cache


def test_register_diffusion_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "PIPELINE_RUNNERS", dict(registry.PIPELINE_RUNNERS))

    class FluxRunner(DiffusersPipelineRunner):
        pipeline_class = "FluxPipeline"

    assert registry.runner_class("FluxPipeline") is DiffusersPipelineRunner  # the generic runner
    registry.register_diffusion_pipeline("FluxPipeline", FluxRunner)
    assert registry.runner_class("FluxPipeline") is FluxRunner
    assert registry.runner_class("GlmImagePipeline") is GlmImageRunner
    with pytest.raises(TypeError):
        registry.register_diffusion_pipeline("X", object)


def test_platform_table_names_the_diffusion_workers(tiny_glm_image: Path) -> None:
    workers = {name: import_object(p.diffusion_worker_cls) for name, p in PLATFORMS.items()}
    assert workers == {"cpu": CPUDiffusionWorker, "cuda": CUDADiffusionWorker, "rocm": CUDADiffusionWorker}
    worker = workers["cpu"]()
    engine = worker.load_model(tiny_glm_image, dtype="auto", max_batch_size=2)
    assert str(engine.dtype) == "torch.float32" and engine.device.type == "cpu"
    results = worker.execute(
        [t2i("w1", seed=1, num_inference_steps=2), t2i("w2", seed=2, num_inference_steps=2)]
    )
    assert all(r.ok for r in results) and [r.batch_size for r in results] == [2, 2]
