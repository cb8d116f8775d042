"""Any diffusers pipeline in the diffusion engine: the generic runner (driven by ``__call__``'s signature) and
the Qwen-Image families, on tiny SD3, FLUX, Qwen-Image and Qwen-Image-Edit. Each request's image equals a
direct diffusers call with the same seed, batched or alone; what no runner can drive is refused up front."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import source_image
from vllm_omni_plugin.diffusion import (
    DiffusionEngine,
    DiffusionEngineConfig,
    DiffusionRequest,
    DiffusionResult,
)
from vllm_omni_plugin.diffusion import diffusers_registry as registry
from vllm_omni_plugin.diffusion.diffusers_runner import DiffusersPipelineRunner
from vllm_omni_plugin.families.diffusers.runner import (
    QwenImageEditPlusRunner,
    QwenImageEditRunner,
    QwenImageRunner,
)
from vllm_omni_testkit.reference.diffusers import reference_image

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow]

STEPS = 4
SIZE = 64
T2I_FAMILIES = ("sd3", "flux", "qwen_image")


@pytest.fixture(scope="module")
def engine_of(request: pytest.FixtureRequest) -> Callable[[str], DiffusionEngine]:
    """The engine of a family (``sd3``, ``flux``, ``qwen_image``, ``qwen_image_edit``), loaded once."""
    loaded: dict[str, DiffusionEngine] = {}

    def get(family: str) -> DiffusionEngine:
        if family not in loaded:
            model = request.getfixturevalue(f"tiny_{family}")
            loaded[family] = DiffusionEngine(model, DiffusionEngineConfig(max_batch_size=4))
        return loaded[family]

    return get


def ask(
    request_id: str, prompt: str, seed: int, guidance: float, steps: int = STEPS, **kw: Any
) -> DiffusionRequest:
    return DiffusionRequest(
        request_id=request_id,
        prompt=prompt,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=seed,
        **kw,
    )


def reference(engine: DiffusionEngine, request: DiffusionRequest) -> np.ndarray:
    """diffusers' own pipeline for the request (its image-to-image or inpainting pipeline where it has
    source images the model's own pipeline does not take, or a mask)."""
    return reference_image(
        engine.model,
        prompt=request.prompt,
        seed=int(request.seed or 0),
        height=SIZE,
        width=SIZE,
        steps=int(request.num_inference_steps or STEPS),
        guidance=float(request.guidance_scale or 0.0),
        negative_prompt=request.negative_prompt,
        images=request.images,
        mask=request.mask,
        strength=request.strength,
    )


def assert_within_one_level(a: np.ndarray, b: np.ndarray) -> None:
    """Equal up to float noise: at most 1/255 apart, in a few pixels."""
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    assert diff.max() <= 1, diff.max()
    assert (diff > 0).mean() < 0.01


def assert_a_real_image(image: np.ndarray) -> None:
    """Random weights still draw structure: not constant, not saturated (a NaN would be 0 everywhere)."""
    assert image.shape == (SIZE, SIZE, 3) and image.std() > 10
    assert ((image == 0) | (image == 255)).mean() < 0.5


def ok(results: list[DiffusionResult]) -> list[DiffusionResult]:
    assert all(r.ok for r in results), [r.error for r in results]
    return results


# --- the generic runner: what it reads from the pipeline ----------------------------------------------


@pytest.mark.parametrize(
    ("family", "runner", "steps", "guidance", "side"),
    [
        ("sd3", DiffusersPipelineRunner, 28, 7.0, 256),  # transformer sample_size 32 x VAE 8
        ("flux", DiffusersPipelineRunner, 28, 3.5, 1024),
        ("qwen_image", QwenImageRunner, 50, 4.0, 1024),  # true_cfg_scale's default
        ("qwen_image_edit", QwenImageEditRunner, 50, 4.0, 1024),
    ],
)
def test_runner_defaults_come_from_the_pipeline(
    engine_of: Callable[[str], DiffusionEngine],
    family: str,
    runner: type,
    steps: int,
    guidance: float,
    side: int,
) -> None:
    engine = engine_of(family)
    assert type(engine.runner) is runner
    loaded = engine.runner
    assert loaded.default_num_inference_steps == steps and loaded.default_guidance_scale == guidance
    read = runner.model_defaults(engine.model).defaults  # from the configs, as the input processor reads them
    assert (read.num_inference_steps, read.guidance_scale, read.height, read.width) == (
        steps,
        guidance,
        side,
        side,
    )


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image", "qwen_image_edit"])
def test_model_facts_without_loading(family: str, request: pytest.FixtureRequest) -> None:
    """Every family takes source images (the text-to-image ones through diffusers' image-to-image pipeline
    of the family) and the text-to-image ones masks (their inpainting pipeline); only the edit model needs
    an image."""
    model = str(request.getfixturevalue(f"tiny_{family}"))
    facts = registry.inspect_model(model)
    edit = family == "qwen_image_edit"
    assert (facts.takes_images, facts.needs_images, facts.takes_mask) == (True, edit, not edit)
    assert facts.pipeline_class == json.loads(Path(model, "model_index.json").read_text())["_class_name"]


# --- equal to diffusers, alone and batched ---------------------------------------------------------------


@pytest.mark.parametrize("family", T2I_FAMILIES)
@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_alone_equals_a_direct_diffusers_call(
    engine_of: Callable[[str], DiffusionEngine], family: str, guidance: float
) -> None:
    engine = engine_of(family)
    request = ask("a", "a red fox in the snow", seed=7, guidance=guidance)
    [result] = ok(engine.generate([request]))
    assert result.batch_size == 1
    assert_a_real_image(result.image)
    assert_within_one_level(result.image, reference(engine, request))


@pytest.mark.parametrize("family", T2I_FAMILIES)
def test_batched_equals_alone_per_request(engine_of: Callable[[str], DiffusionEngine], family: str) -> None:
    engine = engine_of(family)
    negative = "blurry" if engine.runner.supports_negative_prompt else None
    batch = [
        ask("b0", "a red fox", seed=1, guidance=3.0, negative_prompt=negative),
        ask(
            "b1",
            "a photo of a cat in a small house on the shore",
            seed=2,
            guidance=3.0,
            negative_prompt=negative,
        ),
        ask("b2", "the sky is blue", seed=3, guidance=3.0, negative_prompt=negative),
    ]
    together = ok(engine.generate(batch))
    assert [r.batch_size for r in together] == [3, 3, 3]
    for request, result in zip(batch, together, strict=True):
        [alone] = ok(engine.generate([request]))
        assert_within_one_level(result.image, alone.image)
        assert_within_one_level(result.image, reference(engine, request))
    # three prompts, three seeds: three different images
    assert len({r.image.tobytes() for r in together}) == 3


def test_qwen_guidance_mixes_requests_with_and_without_a_negative_prompt(
    engine_of: Callable[[str], DiffusionEngine],
) -> None:
    engine = engine_of("qwen_image")
    batch = [
        ask("q0", "a red fox", seed=4, guidance=4.0, negative_prompt="blurry, dark"),
        ask("q1", "a cat", seed=5, guidance=4.0),
    ]
    together = ok(engine.generate(batch))
    assert [r.batch_size for r in together] == [2, 2]
    for request, result in zip(batch, together, strict=True):
        assert_within_one_level(result.image, reference(engine, request))


def test_a_negative_prompt_splits_a_batch_where_none_differs_from_empty(
    engine_of: Callable[[str], DiffusionEngine],
) -> None:
    engine = engine_of("flux")  # FLUX: a negative prompt turns true CFG on, "" included
    results = ok(
        engine.generate(
            [
                ask("n0", "a cat", seed=1, guidance=3.0, negative_prompt=""),
                ask("n1", "a cat", seed=1, guidance=3.0),
            ]
        )
    )
    assert [r.batch_size for r in results] == [1, 1]


# --- Qwen-Image-Edit -------------------------------------------------------------------------------------


def test_qwen_image_edit_equals_diffusers_alone_and_batched(
    engine_of: Callable[[str], DiffusionEngine],
) -> None:
    engine = engine_of("qwen_image_edit")
    batch = [
        ask("e0", "make it blue", seed=1, guidance=1.0, images=[source_image(64, seed=1)]),
        ask("e1", "add a small house", seed=2, guidance=1.0, images=[source_image(64, seed=2)]),
    ]
    together = ok(engine.generate(batch))
    assert [r.batch_size for r in together] == [2, 2]
    for request, result in zip(batch, together, strict=True):
        assert_a_real_image(result.image)
        assert_within_one_level(result.image, reference(engine, request))
    # the source image matters
    assert together[0].image.tobytes() != together[1].image.tobytes()
    # e0's source edited again (another prompt and seed): not encoded again, the image diffusers gives
    again = ask("e2", "make it green", seed=3, guidance=1.0, images=[source_image(64, seed=1)])
    encodes: list[int] = []
    hook = engine.runner.pipe.vae.encoder.register_forward_hook(lambda *_: encodes.append(1))
    try:
        (result,) = ok(engine.generate([again]))
    finally:
        hook.remove()
    assert not encodes
    assert_within_one_level(result.image, reference(engine, again))


def test_qwen_image_edit_needs_exactly_one_source_image(engine_of: Callable[[str], DiffusionEngine]) -> None:
    engine = engine_of("qwen_image_edit")
    none, two = engine.generate(
        [
            ask("x0", "make it blue", seed=1, guidance=1.0),
            ask("x1", "make it blue", seed=1, guidance=1.0, images=[source_image(64), source_image(64, 1)]),
        ]
    )
    assert "QwenImageEditPipeline edits an image: the request needs a source image" in (none.error or "")
    assert "at most 1 source image(s) per request, got 2" in (two.error or "")


def test_qwen_image_edit_plus_takes_a_list_of_images(tiny_qwen_image_edit: Path, tmp_path: Path) -> None:
    """Qwen-Image-Edit-2509's class on the same components: every source image of a request conditions it."""
    model = tmp_path / "edit-plus"
    model.mkdir()
    for entry in tiny_qwen_image_edit.iterdir():
        if entry.name != "model_index.json":
            os.symlink(entry, model / entry.name)
    index = json.loads((tiny_qwen_image_edit / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImageEditPlusPipeline"}))
    engine = DiffusionEngine(model, DiffusionEngineConfig(max_batch_size=4))
    assert type(engine.runner) is QwenImageEditPlusRunner
    images = [source_image(64, seed=1), source_image(64, seed=2)]
    request = ask("p0", "put them side by side", seed=3, guidance=1.0, steps=2, images=images)
    [result] = ok(engine.generate([request]))
    assert_within_one_level(result.image, reference(engine, request))
    # diffusers has no inpainting pipeline of this family: a mask is refused, naming what it can do
    assert not registry.inspect_model(str(model)).takes_mask
    mask = np.full((64, 64), 255, np.uint8)
    [refused] = engine.generate([ask("p1", "x", seed=3, guidance=1.0, steps=2, images=images[:1], mask=mask)])
    assert (
        "cannot repaint a masked area" in (refused.error or "") and "edits of source images" in refused.error
    )


# --- what cannot be driven ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", T2I_FAMILIES)
def test_masked_edits_and_variations_run_on_the_familys_own_inpainting_and_image_to_image_pipelines(
    engine_of: Callable[[str], DiffusionEngine], family: str
) -> None:
    """A text-to-image model repaints a mask's area with diffusers' inpainting pipeline of its family and
    redraws a source image (a variation, an edit) with its image-to-image one, both built from the loaded
    components: each image equals that diffusers pipeline's own, two masked requests batched as alone; a
    mask of another size, or with two images, fails alone."""
    engine = engine_of(family)
    source = source_image(SIZE, seed=4)
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[16:48, 8:40] = 255
    masked = [
        ask("m1", "a red door", seed=6, guidance=3.0, images=[source], mask=mask, strength=0.8),
        ask("m2", "a blue window", seed=7, guidance=3.0, images=[source], mask=mask, strength=0.8),
    ]
    variation = ask("v", "", seed=8, guidance=3.0, images=[source])
    bad = [
        ask("b1", "x", seed=1, guidance=3.0, images=[source], mask=mask[:32]),
        ask("b2", "x", seed=1, guidance=3.0, images=[source, source], mask=mask),
    ]
    results = engine.generate([*masked, variation, *bad])
    ok(results[:3])
    for request, result in zip([*masked, variation], results, strict=False):
        assert_within_one_level(result.image, reference(engine, request))
        assert_a_real_image(result.image)
    assert "they must match" in (results[3].error or "")
    assert "exactly one source image" in (results[4].error or "")
    assert {type(c).__name__ for c in engine.runner._companions.values()} == {
        registry.companion_class(type(engine.runner.pipe), "mask").__name__,
        registry.companion_class(type(engine.runner.pipe), "images").__name__,
    }


def test_flux_fill_repaints_masks_with_its_own_pipeline_and_refuses_requests_without_one(
    tiny_flux_fill: Path,
) -> None:
    """FLUX.1 Fill's own pipeline is an inpainting one: a masked edit equals FluxFillPipeline's own image
    (two batched as alone), and a request without a mask fails alone, saying what it needs."""
    facts = registry.inspect_model(str(tiny_flux_fill))
    assert (facts.takes_mask, facts.needs_mask, facts.needs_images) == (True, True, True)
    engine = DiffusionEngine(tiny_flux_fill, DiffusionEngineConfig(max_batch_size=4))
    assert (
        engine.runner.pipeline_for(ask("x", "x", 1, 3.5, mask=np.zeros((SIZE, SIZE), np.uint8)))
        is engine.runner.pipe
    )
    source = source_image(SIZE, seed=4)
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[8:40, 16:56] = 255
    masked = [
        ask("f1", "a red door", seed=6, guidance=3.5, images=[source], mask=mask),
        ask("f2", "a green door", seed=9, guidance=3.5, images=[source], mask=mask),
    ]
    results = engine.generate([*masked, ask("t", "a red door", seed=6, guidance=3.5)])
    for request, result in zip(masked, ok(results[:2]), strict=True):
        assert_within_one_level(result.image, reference(engine, request))
        assert_a_real_image(result.image)
    assert "needs an image and a mask" in (results[2].error or "")


def test_a_pipeline_without_the_usual_call_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline"}))
    message = "DDPMPipeline cannot be served: its __call__ takes no prompt, height, width"
    with pytest.raises(registry.UnservablePipelineError, match=message):
        registry.inspect_model(str(tmp_path))
    with pytest.raises(registry.UnservablePipelineError, match=message):
        DiffusionEngine(tmp_path)


def test_a_class_diffusers_lacks_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "NoSuchPipeline"}))
    with pytest.raises(registry.UnknownPipelineError, match=r"has no pipeline class 'NoSuchPipeline'"):
        registry.inspect_model(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="has no model_index.json"):
        registry.inspect_model(str(empty))


# --- progress -------------------------------------------------------------------------------------------


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def engine_log() -> Iterator[list[str]]:
    """The engine's INFO lines while the block runs."""
    from vllm_omni_plugin.diffusion import engine as engine_module

    logger, handler = engine_module.logger, _Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_long_batches_log_progress_and_count_denoise_steps(tiny_sd3: Path) -> None:
    engine = DiffusionEngine(tiny_sd3, DiffusionEngineConfig(max_batch_size=4, progress_interval_s=0))
    reported: list[int] = []
    engine.on_progress = lambda: reported.append(engine.denoise_steps)
    with engine_log() as lines:
        ok(engine.generate([ask(f"r{i}", "a cat", seed=i, guidance=2.0) for i in range(3)]))
    assert engine.denoise_steps == 3 * STEPS  # per request: a step of a batch of 3 counts 3
    assert reported == [3 * (i + 1) for i in range(STEPS)]
    counters = engine.counters()
    # steps are timed from the previous one's end: all but the first, each with the batch's 3 requests
    assert (counters.steps, counters.step_requests) == (STEPS - 1, 3 * (STEPS - 1))
    assert counters.step_seconds > 0 and counters.decodes == 1 and counters.decode_seconds > 0
    assert [line.split(" of ")[0] for line in lines if "steps/s" in line] == [
        f"diffusion: step {i}/{STEPS}" for i in range(1, STEPS + 1)
    ]
    assert any("3 request(s) (r0, r1, r2) done: 4 steps" in line for line in lines)
    quiet = DiffusionEngine(tiny_sd3, runner=engine.runner)  # default interval
    with engine_log() as lines:
        ok(quiet.generate([ask("q", "a cat", seed=1, guidance=2.0)]))
    assert not [line for line in lines if "steps/s" in line or "done" in line]  # a short batch is quiet
    assert quiet.denoise_steps == STEPS


def test_step_batched_groups_log_their_progress_too(tiny_sd3: Path) -> None:
    engine = DiffusionEngine(
        tiny_sd3, DiffusionEngineConfig(max_batch_size=4, progress_interval_s=0, batching="step")
    )
    try:
        with engine_log() as lines:
            (group,), failed = engine.admit([ask(f"g{i}", "a cat", seed=i, guidance=2.0) for i in range(2)])
            assert not failed
            ok(engine.run_group(group))
    finally:
        engine.close()
    assert [line.split(" of ")[0] for line in lines if "steps/s" in line] == [
        f"diffusion: step {i}/{STEPS}" for i in range(1, STEPS + 1)
    ]
    assert any("2 request(s) (g0, g1) done: 4 steps" in line for line in lines)
    assert engine.denoise_steps == 2 * STEPS
