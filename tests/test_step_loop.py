"""The step loop (``diffusion/step_loop.py``) on the tiny SD3 against diffusers' own pipeline: a request
alone gives the pipeline's image bit for bit; requests that join mid-way, leave early, mix guidance and
image sizes, or are preempted by a higher-priority one and resumed, each get the image they get alone
(within 1/255)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import pytest
import torch

from vllm_omni_plugin.diffusion.lora import AdapterLayer
from vllm_omni_plugin.diffusion.params import DiffusionRequest
from vllm_omni_plugin.diffusion.parking import StateParking, state_tensors, storage_key
from vllm_omni_plugin.diffusion.previews import PreviewLayer
from vllm_omni_plugin.diffusion.runner import RunnerContext
from vllm_omni_plugin.diffusion.step_cache import StepCacheLayer
from vllm_omni_plugin.diffusion.step_loop import DecodeBeside, StepLoop
from vllm_omni_plugin.families.diffusers.steps import SD3Steps

T = TypeVar("T")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pipe(tiny_sd3: Path) -> Any:
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3), torch_dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def request(i: int, steps: int = 4, guidance: float = 5.0, size: int = 64) -> DiffusionRequest:
    return DiffusionRequest(request_id=f"r{i}", prompt=f"a photo of thing {i}", seed=100 + i, height=size,
                            width=size, num_inference_steps=steps, guidance_scale=guidance)  # fmt: skip


def alone(pipe: Any, r: DiffusionRequest) -> np.ndarray:
    with torch.no_grad():
        image = pipe(
            prompt=r.prompt, negative_prompt="", height=r.height, width=r.width,
            num_inference_steps=r.num_inference_steps, guidance_scale=r.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(r.seed), output_type="np",
        ).images[0]  # fmt: skip
    return (image * 255).round().astype(np.uint8)


def run(loop: StepLoop, until: int | None = None) -> dict[str, Any]:
    done = {}
    with torch.no_grad():
        while not loop.idle() and (until is None or loop.counters.steps < until):
            for finished in loop.step():
                done[finished.request_id] = finished
    return done


def diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def family_request(family: str, request_id: str, seed: int, **fields: Any) -> DiffusionRequest:
    """A 64x64 request of ``family`` (GLM-Image's with random prior tokens: its DiT takes any)."""
    common = {"request_id": request_id, "prompt": f"a lantern {seed}", "seed": seed, "height": 64, "width": 64,
              **fields}  # fmt: skip
    if family != "glm_image":
        return DiffusionRequest(**common)
    from test_step_batching import token_ids
    from vllm_omni_plugin.families.glm_image.runner import GlmImageRequest

    return GlmImageRequest(**common, prior_token_ids=token_ids(16, seed))


def layer_of(pieces: Any, kind: type[T]) -> T:
    """The family's layer of this kind (there is one)."""
    (layer,) = (layer for layer in pieces.layers if isinstance(layer, kind))
    return layer


def whole_call(runner: Any, r: DiffusionRequest) -> np.ndarray:
    """The request's image from the runner's whole pipeline call, alone."""
    runner.validate(r)
    return runner.run([r], [torch.Generator().manual_seed(r.seed)]).images[0]


def test_a_request_alone_is_the_pipelines_image_bit_for_bit(pipe: Any) -> None:
    r = request(0)
    loop = StepLoop(SD3Steps(pipe), max_rows=8)
    loop.add(r.request_id, r)
    image = run(loop)["r0"].image
    assert image.std() > 5 and diff(image, alone(pipe, r)) == 0


def test_joining_mid_way_leaving_early_mixed_guidance_and_sizes(pipe: Any) -> None:
    loop = StepLoop(SD3Steps(pipe), max_rows=16)
    first, aborted = request(1, steps=8), request(2, steps=8)
    loop.add(first.request_id, first)
    loop.add(aborted.request_id, aborted)
    done = run(loop, until=3)
    assert not done
    assert loop.abort(aborted.request_id)
    late = [
        request(3, steps=4, guidance=1.0),
        request(4, steps=4, guidance=7.0),
        request(5, steps=3, size=96),
    ]
    for r in late:
        loop.add(r.request_id, r)
    done = run(loop)
    assert sorted(done) == ["r1", "r3", "r4", "r5"]
    assert loop.counters.encoder_calls == 2 and loop.counters.preemptions == 0
    for r in (first, *late):
        assert diff(done[r.request_id].image, alone(pipe, r)) <= 1, r.request_id


def test_finished_requests_decode_beside_the_next_step_with_the_image_they_get_alone(pipe: Any) -> None:
    """With a decoder, a request finished while others of its priority run decodes on the decoder's
    thread beside the next steps, a step after it ended returning its image (at the latest, the last
    request's, which decodes at once after it); the last decodes at once."""
    loop = StepLoop(SD3Steps(pipe), max_rows=8, decoder=DecodeBeside(torch.device("cpu")))
    short, long = request(8, steps=2), request(9, steps=4)
    for r in (short, long):
        loop.add(r.request_id, r)
    returned = []
    with torch.no_grad():
        while not loop.idle():
            returned += [(f, loop.counters.steps) for f in loop.step()]
            if loop.counters.steps == 2:
                assert loop.decoding is not None and [i.request_id for i in loop.decoding.items] == ["r8"]
    assert [f.request_id for f, _ in returned] == ["r8", "r9"] and returned[1][1] == 4
    assert returned[0][1] in (3, 4)  # the step during which its decode ended
    for (f, _), r in zip(returned, (short, long), strict=True):
        assert diff(f.image, alone(pipe, r)) <= 1 and f.seconds["decode"] > 0, r.request_id
    for r in (short, long):  # drained (a loop about to be held): the decode in flight is waited for
        loop.add(r.request_id, r)
    with torch.no_grad():
        assert loop.step() == [] and loop.step() == [] and loop.decoding is not None
        drained = loop.drain_decodes()
        assert loop.decoding is None and [f.request_id for f in drained] == ["r8"]
        assert diff(drained[0].image, returned[0][0].image) == 0 and sorted(run(loop)) == ["r9"]


@pytest.mark.parametrize("decoder", [None, DecodeBeside(torch.device("cpu"))], ids=["inline", "beside"])
def test_a_higher_priority_request_preempts_and_the_preempted_one_resumes_unchanged(
    pipe: Any, decoder: DecodeBeside | None
) -> None:
    """With a decoder too, the better request decodes at once: its answer does not wait for a worse
    request's step."""
    loop = StepLoop(SD3Steps(pipe), max_rows=2, decoder=decoder)  # one guided request per step
    low, high = request(6, steps=6), request(7, steps=3)
    loop.add(low.request_id, low, priority=1)
    run(loop, until=2)
    loop.add(high.request_id, high, priority=0)
    finished = []
    with torch.no_grad():
        while not loop.idle():
            finished += [(f, loop.counters.steps) for f in loop.step()]
    assert [(f.request_id, step) for f, step in finished] == [("r7", 5), ("r6", 9)]
    assert finished[1][0].preemptions == 3 and loop.counters.preemptions == 3
    for f, _ in finished:  # each ran alone in every step it ran: both exact
        r = high if f.request_id == "r7" else low
        assert diff(f.image, alone(pipe, r)) == 0, f.request_id


def test_a_step_keeps_to_its_budgets_and_a_request_over_them_runs_alone(pipe: Any) -> None:
    """A token budget (the stage's ``max_step_tokens``) that holds one 64x64 guided request: the second
    waits for the first to finish; one larger than the budget still runs, alone."""

    def tokens(r: DiffusionRequest) -> int:
        return (r.height // 16) * (r.width // 16) * 2

    loop = StepLoop(SD3Steps(pipe), max_rows=16, budgets=[(50, tokens)])
    first, second, large = request(20, steps=2), request(21, steps=2), request(22, steps=2, size=96)
    for r in (first, second, large):
        loop.add(r.request_id, r)
    order = []
    with torch.no_grad():
        while not loop.idle():
            ran = loop.ran
            order += [(f.request_id, f.image) for f in loop.step()]
            assert len(loop.ran) == 1, (ran, loop.ran)
    assert [name for name, _ in order] == ["r20", "r21", "r22"]
    for (_, image), r in zip(order, (first, second, large), strict=True):
        assert diff(image, alone(pipe, r)) == 0, r.request_id  # each ran alone: exact


@pytest.fixture(scope="module")
def flux(tiny_flux: Path) -> Any:
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(str(tiny_flux), torch_dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def flux_alone(flux: Any, r: DiffusionRequest) -> np.ndarray:
    with torch.no_grad():
        image = flux(
            prompt=r.prompt, height=r.height, width=r.width, num_inference_steps=r.num_inference_steps,
            guidance_scale=r.guidance_scale, generator=torch.Generator("cpu").manual_seed(r.seed), output_type="np",
        ).images[0]  # fmt: skip
    return (image * 255).round().astype(np.uint8)


def test_flux_alone_exact_and_mixed_guidance_and_sizes_in_one_loop(flux: Any) -> None:
    from vllm_omni_plugin.families.diffusers.steps import FluxSteps

    requests = [request(10, guidance=3.5), request(11, steps=3, guidance=5.0), request(12, size=96)]
    loop = StepLoop(FluxSteps(flux), max_rows=8)
    loop.add(requests[0].request_id, requests[0])
    assert diff(run(loop)["r10"].image, flux_alone(flux, requests[0])) == 0
    for r in requests:
        loop.add(r.request_id, r)
    done = run(loop)
    for r in requests:
        assert done[r.request_id].image.std() > 5
        assert diff(done[r.request_id].image, flux_alone(flux, r)) <= 1, r.request_id


def test_qwen_image_alone_exact_and_mixed_guidance_steps_and_prompt_lengths_in_one_loop(
    tiny_qwen_image: Path,
) -> None:
    """True CFG as the pipeline runs it (prompts' rows in one forward, negative prompts' in a second):
    alone bit for bit; beside others, with padded prompts of other lengths, within 1/255."""
    from diffusers import QwenImagePipeline

    from vllm_omni_plugin.families.diffusers.steps import QwenImageSteps

    qwen = QwenImagePipeline.from_pretrained(str(tiny_qwen_image), torch_dtype=torch.float32)
    qwen.set_progress_bar_config(disable=True)

    def qwen_alone(r: DiffusionRequest) -> np.ndarray:
        cfg = {"negative_prompt": " "} if r.guidance_scale > 1 else {}
        with torch.no_grad():
            image = qwen(
                prompt=r.prompt, height=r.height, width=r.width, num_inference_steps=r.num_inference_steps,
                true_cfg_scale=r.guidance_scale, generator=torch.Generator("cpu").manual_seed(r.seed),
                output_type="np", **cfg,
            ).images[0]  # fmt: skip
        return (image * 255).round().astype(np.uint8)

    first = request(30, guidance=3.0)
    loop = StepLoop(QwenImageSteps(qwen), max_rows=16)
    longer = DiffusionRequest(request_id="r33", prompt="a much longer prompt about a red fox in the snow at dusk",
                              seed=133, height=64, width=64, num_inference_steps=4, guidance_scale=3.0)  # fmt: skip
    mixed = [request(31, steps=5, guidance=3.0), request(32, steps=3, guidance=1.0), longer]
    assert_alone_then_mixed(loop, first, mixed, qwen_alone)


def assert_alone_then_mixed(
    loop: StepLoop, first: DiffusionRequest, mixed: list[DiffusionRequest], alone: Any
) -> None:
    """``first`` through the loop alone: bit for bit ``alone(first)``; then ``mixed`` together: each a real
    image within 1/255 of its own ``alone``."""
    loop.add(first.request_id, first)
    assert diff(run(loop)[first.request_id].image, alone(first)) == 0
    for r in mixed:
        loop.add(r.request_id, r)
    done = run(loop)
    for r in mixed:
        assert done[r.request_id].image.std() > 5
        assert diff(done[r.request_id].image, alone(r)) <= 1, r.request_id


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image", "glm_image"])
def test_adapters_mixed_in_one_step_each_give_the_image_diffusers_gives_with_it_loaded(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    """The served runner's step-loop pieces, LoRA as their row layer: a request with adapter A runs two
    steps alone, then one with B and one with none join; each image is diffusers' own with that adapter
    loaded (PEFT) at that scale, within 1/255 (GLM-Image, which diffusers loads no LoRA into: its whole
    call's, itself checked against the adapter merged into the weights in ``test_lora.py``)."""
    from vllm_omni_plugin.diffusion.diffusers_registry import load_pipeline_runner
    from vllm_omni_plugin.diffusion.lora import LoraSpec
    from vllm_omni_plugin.tiny_models.lora import build_lora
    from vllm_omni_testkit.reference.diffusers import reference_image

    model = request.getfixturevalue(f"tiny_{family}")
    runner = load_pipeline_runner(str(model), dtype=torch.float32, device="cpu")
    pieces = runner.step_family()
    specs = [
        LoraSpec(name=name, path=str(build_lora(model, tmp_path_factory.mktemp(f"lora_{name}"), seed=seed)),
                 scale=scale)
        for name, seed, scale in (("a", 1, 0.8), ("b", 2, 1.0))
    ]  # fmt: skip
    guidance = 3.5 if family == "flux" else 2.0
    asks = [
        family_request(family, f"l{k}", k, num_inference_steps=4, guidance_scale=guidance, lora=spec)
        for k, spec in enumerate([*specs, None])
    ]
    assert all(pieces.runs(r) for r in asks)
    loop = StepLoop(pieces, max_rows=16)
    loop.add(asks[0].request_id, asks[0])
    run(loop, until=2)
    for r in asks[1:]:
        loop.add(r.request_id, r)
    done = run(loop)
    plain = None

    def expected(r: DiffusionRequest) -> np.ndarray:
        if family == "glm_image":
            return whole_call(runner, r)
        lora = None if r.lora is None else (r.lora.name, r.lora.path, r.lora.scale)
        return reference_image(model, prompt=r.prompt, seed=r.seed, height=64, width=64, steps=4,
                               guidance=guidance, lora=lora)  # fmt: skip

    for r in asks:
        assert diff(done[r.request_id].image, expected(r)) <= 1, r.request_id
        if r.lora is not None and plain is None:
            plain = expected(msgspec.structs.replace(r, lora=None))
            assert np.abs(plain.astype(int) - expected(r).astype(int)).mean() > 1  # the adapter acts
    assert not layer_of(pieces, AdapterLayer).chosen  # finished requests leave the layer


@pytest.mark.parametrize("family", ["sd3", "qwen_image", "glm_image"])
def test_previews_in_the_loop_are_the_whole_calls_previews_and_come_before_the_image(
    request: pytest.FixtureRequest, family: str
) -> None:
    """Previews as the loop's layer: a request asking for two previews runs beside one asking none and
    one joining mid-way; its previews are those the whole-request call makes for it alone (within
    1/255), each made before its final image is decoded, and the others get none."""
    from vllm_omni_plugin.diffusion.diffusers_registry import load_pipeline_runner

    model = request.getfixturevalue(f"tiny_{family}")
    runner = load_pipeline_runner(str(model), dtype=torch.float32, device="cpu")
    got: list[tuple[str, int, np.ndarray]] = []
    runner.attach(RunnerContext(on_preview=lambda *preview: got.append(preview)))
    pieces = runner.step_family()
    asks = [
        family_request(family, f"p{k}", k, num_inference_steps=6, guidance_scale=2.0,
                       partial_images=2 if k == 0 else 0)
        for k in range(3)
    ]  # fmt: skip
    assert all(pieces.runs(r) for r in asks)
    loop = StepLoop(pieces, max_rows=16)
    for r in asks[:2]:
        loop.add(r.request_id, r)
    run(loop, until=2)
    loop.add(asks[2].request_id, asks[2])
    finished: list[str] = []
    with torch.no_grad():
        while not loop.idle():
            for f in loop.step():
                finished.append(f.request_id)
                assert f.request_id != "p0" or len(got) == 2  # its previews are out before its image
    assert sorted(finished) == ["p0", "p1", "p2"]
    assert [(name, index) for name, index, _ in got] == [("p0", 0), ("p0", 1)]
    in_loop = [image for _, _, image in got]
    got.clear()
    runner.run([asks[0]], [torch.Generator().manual_seed(0)])
    assert [(name, index) for name, index, _ in got] == [("p0", 0), ("p0", 1)]
    for mine, whole in zip(in_loop, (image for _, _, image in got), strict=True):
        assert mine.shape == (64, 64, 3) and diff(mine, whole) <= 1
    assert not layer_of(pieces, PreviewLayer).wanted


def cached_beside_others(loop: StepLoop, alone: np.ndarray, asks: tuple[Any, Any, Any], whole: Any) -> None:
    """A fixed-policy request's image alone (``alone``) is its whole call's cached one, not its uncached
    one; then beside an uncached request, a threshold-policy one joining mid-way, each gets its whole
    call's image (within 1/255)."""
    fixed, uncached, threshold = asks
    assert diff(alone, whole(fixed)) == 0
    assert diff(alone, whole(msgspec.structs.replace(fixed, cache=None))) > 1  # caching acts
    for r in (fixed, uncached):
        loop.add(r.request_id, r)
    run(loop, until=loop.counters.steps + 3)
    loop.add(threshold.request_id, threshold)
    done = run(loop)
    for r in asks:
        assert diff(done[r.request_id].image, whole(r)) <= 1, r.request_id


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image", "glm_image"])
def test_cached_and_uncached_requests_share_steps_each_with_the_image_it_gets_alone(
    request: pytest.FixtureRequest, family: str
) -> None:
    """Step caching as the loop's layer: a fixed-policy request alone skips exactly the forwards its plan
    skips and gives the whole call's cached image; beside an uncached request and a threshold-policy one
    joining mid-way, each gets the image its whole call gives alone (within 1/255)."""
    from vllm_omni_plugin.diffusion.diffusers_registry import load_pipeline_runner
    from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec, fixed_plan

    model = request.getfixturevalue(f"tiny_{family}")
    runner = load_pipeline_runner(str(model), dtype=torch.float32, device="cpu")
    counts = [0, 0]
    runner.attach(RunnerContext(on_cache_counts=lambda _, cached: counts.__setitem__(1, counts[1] + cached)))
    pieces = runner.step_family()
    forwards = [0]
    runner.pipe.transformer.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    guidance = 3.5 if family == "flux" else 2.0
    calls = 2 if family in ("qwen_image", "glm_image") else 1  # guidance as a second forward

    def ask(k: int, policy: str | None) -> DiffusionRequest:
        spec = None if policy is None else StepCacheSpec(policy=policy).resolved()  # as the engine resolves
        return family_request(family, f"c{k}", k, num_inference_steps=8, guidance_scale=guidance, cache=spec)

    def whole(r: DiffusionRequest) -> np.ndarray:
        return whole_call(runner, r)

    fixed, uncached, threshold = ask(0, "fixed"), ask(1, None), ask(2, "threshold")
    plan = fixed_plan(fixed.cache, 8)
    loop = StepLoop(pieces, max_rows=16)
    loop.add(fixed.request_id, fixed)
    alone = run(loop)["c0"].image
    assert forwards[0] == calls * sum(plan) and counts[1] == calls * (8 - sum(plan)) * runner.cache_blocks
    cached_beside_others(loop, alone, (fixed, uncached, threshold), whole)
    cache_layer = layer_of(pieces, StepCacheLayer)
    assert not cache_layer.caches and not cache_layer.slots


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image"])
def test_image_to_image_in_the_loop_gives_the_image_to_image_pipelines_image(
    request: pytest.FixtureRequest, family: str
) -> None:
    """Edits as the family's image-to-image pipeline runs them (the runner's whole call: diffusers'
    ``StableDiffusion3Img2ImgPipeline``, ``FluxImg2ImgPipeline``, ``QwenImageImg2ImgPipeline`` from the
    same components): alone bit for bit, its strength skipping the first steps; beside a text-to-image
    request and an edit of the pipeline's default strength joining mid-way, each within 1/255 of its
    whole call. Masked edits too, as ``StableDiffusion3InpaintPipeline``, ``FluxInpaintPipeline`` and
    ``QwenImageInpaintPipeline`` run them: alone bit for bit, with the previews its whole call makes
    (decoded as the inpainting pipeline decodes: SD3's without the VAE's shift factor), then among the
    others."""
    from vllm_omni_plugin.diffusion.diffusers_registry import load_pipeline_runner

    runner = load_pipeline_runner(str(request.getfixturevalue(f"tiny_{family}")), dtype=torch.float32,
                                  device="cpu")  # fmt: skip
    previews: list[tuple[Any, ...]] = []
    runner.attach(RunnerContext(on_preview=lambda *preview: previews.append(preview)))
    pieces = runner.step_family()
    sources = np.random.default_rng(0).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    guidance = {"flux": 3.5, "qwen_image": 3.0}.get(family, 4.0)

    def ask(k: int, strength: float | None = None, images: bool = True) -> DiffusionRequest:
        return DiffusionRequest(request_id=f"e{k}", prompt=f"a red fox {k}", seed=50 + k, height=64, width=64,
                                num_inference_steps=6, guidance_scale=guidance,
                                images=[sources[k % 2]] if images else None, strength=strength)  # fmt: skip

    first, text, default = ask(0, 0.7), ask(1, images=False), ask(2)
    assert pieces.runs(first) and pieces.runs(default)
    mask = np.zeros((64, 64), np.uint8)
    mask[8:40, 16:56] = 255  # repainted there, the source kept elsewhere
    masked = msgspec.structs.replace(ask(3), mask=mask, partial_images=2)
    assert pieces.runs(masked)
    loop = StepLoop(pieces, max_rows=16)
    loop.add(masked.request_id, masked)
    inpainted = run(loop)["e3"].image
    in_loop = [image for *_, image in previews]
    previews.clear()
    assert diff(inpainted, whole_call(runner, masked)) == 0
    assert [(name, index) for name, index, _ in previews] == [("e3", 0), ("e3", 1)] and len(in_loop) == 2
    for mine, whole in zip(in_loop, (image for *_, image in previews), strict=True):
        assert diff(mine, whole) <= 1
    assert diff(inpainted, whole_call(runner, ask(3))) > 8  # the mask matters
    loop = StepLoop(pieces, max_rows=16)
    loop.add(first.request_id, first)
    alone = run(loop)["e0"].image
    assert loop.counters.steps == 6 - pieces.first_step(first) == 5  # 6 x 0.7 = 4.2 steps, as diffusers
    assert alone.std() > 5 and diff(alone, whole_call(runner, first)) == 0
    for r in (first, text):
        loop.add(r.request_id, r)
    run(loop, until=loop.counters.steps + 2)
    for r in (default, masked):
        loop.add(r.request_id, r)
    done = run(loop)
    for r in (first, text, default, masked):
        assert diff(done[r.request_id].image, whole_call(runner, r)) <= 1, r.request_id


def test_glm_image_alone_exact_and_mixed_guidance_and_glyph_lengths_in_one_loop(tiny_glm_image: Path) -> None:
    """GLM-Image's DiT from prior tokens: alone, its whole call's image (and final latents, asked for) bit
    for bit; requests with other guidance (none: one forward), other glyph lengths (a forward of their
    own) and joining mid-way each get the image they get alone (within 1/255)."""
    from vllm_omni_plugin.diffusion.diffusers_registry import load_pipeline_runner

    runner = load_pipeline_runner(str(tiny_glm_image), dtype=torch.float32, device="cpu")
    pieces = runner.step_family()
    first = family_request(
        "glm_image", "g0", 0, num_inference_steps=5, guidance_scale=1.5, return_latents=True
    )
    loop = StepLoop(pieces, max_rows=16)
    loop.add(first.request_id, first)
    finished = run(loop)["g0"]
    whole = runner.run([first], [torch.Generator().manual_seed(0)])
    assert finished.image.std() > 5 and diff(finished.image, whole.images[0]) == 0
    assert whole.latents is not None and torch.equal(finished.latents, whole.latents[0])  # as asked
    others = [
        family_request("glm_image", "g1", 1, num_inference_steps=4, guidance_scale=1.0),
        family_request("glm_image", "g2", 2, num_inference_steps=3, guidance_scale=3.0,
                       prompt='a sign that says "OPEN ALL NIGHT"'),
    ]  # fmt: skip
    loop.add(first.request_id, first)
    run(loop, until=loop.counters.steps + 2)
    for r in others:
        loop.add(r.request_id, r)
    done = run(loop)
    assert (
        pieces.shape(loop_state := pieces.prepare(others[1], pieces.encode([others[1]])[0]))
        != pieces.shape(pieces.prepare(first, pieces.encode([first])[0]))
        and loop_state.embeds.shape[1] > 1
    )  # the quoted text is a glyph length of its own
    for r in (first, *others):
        assert diff(done[r.request_id].image, whole_call(runner, r)) <= 1, r.request_id


def test_glm_image_edits_in_the_loop_each_give_their_whole_calls_image(tiny_glm_image: Path) -> None:
    """GLM-Image edits step-wise: alone, the whole call's image bit for bit; two edits sharing steps (their
    source-image K/V joined per row), one of them step-cached (so its rows cannot be taken apart: every
    row runs, it takes its estimates), beside a text-to-image request joining mid-way, each within 1/255
    of its whole call alone."""
    from test_step_batching import glm_edit
    from vllm_omni_plugin.diffusion.diffusers_registry import load_pipeline_runner
    from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec

    runner = load_pipeline_runner(str(tiny_glm_image), dtype=torch.float32, device="cpu")
    pieces = runner.step_family()
    first = glm_edit("e0", 10, steps=5)
    assert pieces.runs(first)
    loop = StepLoop(pieces, max_rows=16)
    loop.add(first.request_id, first)
    alone = run(loop)["e0"].image
    assert diff(alone, whole_call(runner, first)) == 0
    text = family_request("glm_image", "t0", 0, num_inference_steps=4, guidance_scale=1.5)
    assert diff(alone, whole_call(runner, msgspec.structs.replace(first, images=None, prior_token_image_ids=None,
                                                                  source_image_grid_thw=None))) > 1  # fmt: skip
    cached = msgspec.structs.replace(
        glm_edit("e1", 11, steps=8), cache=StepCacheSpec(policy="fixed").resolved()
    )
    for r in (first, cached):
        loop.add(r.request_id, r)
    run(loop, until=loop.counters.steps + 2)
    loop.add(text.request_id, text)
    done = run(loop)
    for r in (first, cached, text):
        assert diff(done[r.request_id].image, whole_call(runner, r)) <= 1, r.request_id


def test_bagel_alone_exact_and_mixed_contexts_guidance_and_previews_in_one_loop(tiny_bagel: Path) -> None:
    """BAGEL's generation stage step-wise: alone, its whole call's image bit for bit; a text-to-image
    request, an edit (three distinct contexts, image guidance) and one with a longer prompt and no
    guidance joining mid-way share each step (their context rows joined, padded to the longest), each
    within 1/255 of its whole call alone; a request's previews are the whole call's (x - t * v)."""
    from test_bagel_dit import edit, t2i
    from vllm_omni_plugin.families.bagel.runner import BagelGenerationRunner

    runner = BagelGenerationRunner.load(str(tiny_bagel), dtype=torch.float32, device="cpu")
    got: list[tuple[str, int, np.ndarray]] = []
    runner.attach(RunnerContext(on_preview=lambda *preview: got.append(preview)))
    pieces = runner.step_family()

    def whole(r: Any) -> np.ndarray:
        return runner.run([r], [torch.Generator("cpu").manual_seed(r.seed)]).images[0]

    first = t2i("b0", 0)
    loop = StepLoop(pieces, max_rows=16)
    loop.add(first.request_id, first)
    alone = run(loop)["b0"].image
    assert alone.std() > 5 and diff(alone, whole(first)) == 0
    previewed = msgspec.structs.replace(edit("b1", 1), partial_images=2)
    late = t2i("b2", 2, prompt_len=30, cfg_text_scale=1.0)
    assert all(pieces.runs(r) for r in (first, previewed, late))
    for r in (first, previewed):
        loop.add(r.request_id, r)
    run(loop, until=loop.counters.steps + 3)
    loop.add(late.request_id, late)
    done = run(loop)
    in_loop = [(name, index, image) for name, index, image in got]
    assert [(name, index) for name, index, _ in in_loop] == [("b1", 0), ("b1", 1)]
    got.clear()
    for r in (first, previewed, late):
        assert diff(done[r.request_id].image, whole(r)) <= 1, r.request_id
    assert [(name, index) for name, index, _ in got] == [("b1", 0), ("b1", 1)]
    for (_, _, mine), (_, _, theirs) in zip(in_loop, got, strict=True):
        assert diff(mine, theirs) <= 1


def test_bagel_cached_and_uncached_requests_share_steps_each_with_its_whole_calls_image(
    tiny_bagel: Path,
) -> None:
    """BAGEL's step caching as the loop's layer that answers a step with its guided velocity: a
    fixed-policy request alone leaves out of the forward exactly the steps its plan skips and gives its
    whole call's cached image bit for bit; beside an uncached request and a threshold-policy one joining
    mid-way, each within 1/255 of its whole call alone."""
    from test_bagel_dit import t2i
    from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec, fixed_plan
    from vllm_omni_plugin.families.bagel.runner import BagelGenerationRunner, flow_schedule

    runner = BagelGenerationRunner.load(str(tiny_bagel), dtype=torch.float32, device="cpu")
    counts = [0, 0]
    runner.attach(RunnerContext(on_cache_counts=lambda _, cached: counts.__setitem__(1, counts[1] + cached)))
    pieces = runner.step_family()
    forwards = [0]
    velocity = runner.transformer.velocity
    runner.transformer.velocity = lambda *a, **k: (
        forwards.__setitem__(0, forwards[0] + 1),
        velocity(*a, **k),
    )[1]

    def ask(k: int, policy: str | None) -> Any:
        spec = None if policy is None else StepCacheSpec(policy=policy).resolved()
        return msgspec.structs.replace(t2i(f"c{k}", k), cache=spec)

    def whole(r: Any) -> np.ndarray:
        return runner.run([r], [torch.Generator("cpu").manual_seed(r.seed)]).images[0]

    fixed, uncached, threshold = ask(0, "fixed"), ask(1, None), ask(2, "threshold")
    assert all(pieces.runs(r) for r in (fixed, uncached, threshold))
    steps = len(flow_schedule(fixed.sampling.num_inference_steps, fixed.sampling.timestep_shift)[0])
    plan = fixed_plan(fixed.cache, steps)
    loop = StepLoop(pieces, max_rows=16)
    loop.add(fixed.request_id, fixed)
    alone = run(loop)["c0"].image
    assert forwards[0] == sum(plan) and counts[1] == (steps - sum(plan)) * runner.transformer.num_layers
    cached_beside_others(loop, alone, (fixed, uncached, threshold), whole)
    cache_layer = pieces.layers[-1]
    assert not cache_layer.caches and not cache_layer.computing


@pytest.mark.parametrize("family", ["flux", "qwen_image", "glm_image", "bagel"])
def test_each_family_preempted_resumes_unchanged_and_an_aborted_one_leaves(
    request: pytest.FixtureRequest, family: str
) -> None:
    """Preemption and abort for every family's pieces: a worse request runs two steps, a better one and
    another worse one join; the better runs alone to its end (the other worse one aborted while it
    waits), the first parked meanwhile (every tensor of its state that the better one does not share),
    then the first resumes where it stopped; both give their whole call's image bit for bit (each ran
    alone at every step)."""
    model = request.getfixturevalue(f"tiny_{family}")
    if family == "bagel":
        from test_bagel_dit import t2i
        from vllm_omni_plugin.families.bagel.runner import BagelGenerationRunner

        runner: Any = BagelGenerationRunner.load(str(model), dtype=torch.float32, device="cpu")
        low, high, gone = t2i("w0", 0), t2i("w1", 1), t2i("w2", 2)
    else:
        from vllm_omni_plugin.diffusion.diffusers_registry import load_pipeline_runner

        runner = load_pipeline_runner(str(model), dtype=torch.float32, device="cpu")
        guidance = 3.5 if family == "flux" else 2.0
        low, high, gone = (
            family_request(family, f"w{k}", k, num_inference_steps=5, guidance_scale=guidance)
            for k in range(3)
        )
    # A memory budget with no room: the preempted state is parked (between two CPU storages here).
    parking = StateParking(torch.device("cpu"), room=0, need=lambda r: 0)
    loop = StepLoop(runner.step_family(), max_rows=3, parking=parking)  # one request's rows per step
    loop.add(low.request_id, low, priority=1)
    run(loop, until=2)
    loop.add(high.request_id, high, priority=0)
    loop.add(gone.request_id, gone, priority=1)
    finished: dict[str, Any] = {}
    ran: list[list[str]] = []
    with torch.no_grad():
        while not loop.idle():
            finished |= {f.request_id: f for f in loop.step()}
            ran.append(loop.ran)
            if len(ran) == 1:
                assert loop.abort("w2")  # waiting, never run
                parked, running = (next(i for i in loop.running if i.request_id == k) for k in ("w0", "w1"))
                assert parked.parked is not None and running.parked is None
                theirs = {storage_key(t) for t in state_tensors(running.state)}
                mine = {storage_key(t) for t in state_tensors(parked.state) if t.numel()}
                assert storage_key(parked.state.latents) in parked.parked.storages
                assert parked.parked.storages == mine - theirs  # all it holds alone, nothing it shares
    assert list(finished) == ["w1", "w0"] and finished["w0"].preemptions >= 1
    assert loop.counters.parked == 1 and all(i.parked is None for i in loop.running)
    assert all(step == ["w1"] for step in ran[: ran.index(["w0"])]) and ["w2"] not in ran
    for r in (low, high):
        assert diff(finished[r.request_id].image, whole_call(runner, r)) == 0, r.request_id


def test_qwen_image_edit_alone_exact_and_mixed_sources_guidance_and_steps_in_one_loop(
    tiny_qwen_image_edit: Path,
) -> None:
    """An edit as the served runner sends it (its source resized to about a megapixel): alone, bit for bit
    the pipeline's image; beside others (guided and not, other prompt lengths and step counts, an
    unguided one's source of another aspect in a forward of its own, the first's source edited again:
    not encoded again), each within 1/255."""
    from PIL import Image

    from helpers import source_image
    from vllm_omni_plugin.families.diffusers.steps import QwenImageEditSteps
    from vllm_omni_testkit.reference.diffusers import load_reference_pipeline, reference_image

    def edit(i: int, steps: int, guidance: float, source: np.ndarray, prompt: str = "") -> DiffusionRequest:
        return DiffusionRequest(request_id=f"r{i}", prompt=prompt or f"make thing {i} red", seed=100 + i,
                                height=64, width=64, num_inference_steps=steps, guidance_scale=guidance,
                                images=[source])  # fmt: skip

    def edit_alone(r: DiffusionRequest) -> np.ndarray:
        return reference_image(
            tiny_qwen_image_edit, prompt=r.prompt, seed=r.seed, height=64, width=64,
            steps=r.num_inference_steps, guidance=r.guidance_scale, images=r.images,
        )  # fmt: skip

    pipe = load_reference_pipeline(str(tiny_qwen_image_edit))
    family = QwenImageEditSteps(pipe)
    wide = np.asarray(Image.fromarray(source_image(64, seed=5)).resize((64, 48)))
    first = edit(40, 2, 3.0, source_image(64, seed=1))
    assert family.runs(first) and not family.runs(msgspec.structs.replace(first, images=None))
    mixed = [
        edit(41, 3, 1.0, wide),
        edit(42, 2, 3.0, source_image(64, seed=3), prompt="turn the whole scene into a snowy winter night"),
        edit(43, 2, 3.0, source_image(64, seed=1), prompt="make the sky green"),
    ]
    encodes: list[int] = []
    pipe.vae.encoder.register_forward_hook(lambda *_: encodes.append(1))
    assert_alone_then_mixed(StepLoop(family, max_rows=16), first, mixed, edit_alone)
    assert len(encodes) == 3 and len(family.sources.entries) == 3  # r43's source is r40's
