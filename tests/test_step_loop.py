"""The step loop (``diffusion/step_loop.py``) on the tiny SD3 against diffusers' own pipeline: a request
alone gives the pipeline's image bit for bit; requests that join mid-way, leave early, mix guidance and
image sizes, or are preempted by a higher-priority one and resumed, each get the image they get alone
(within 1/255)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from vllm_omni_plugin.diffusion.params import DiffusionRequest
from vllm_omni_plugin.diffusion.step_loop import StepLoop
from vllm_omni_plugin.families.diffusers.steps import SD3Steps

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


def test_a_higher_priority_request_preempts_and_the_preempted_one_resumes_unchanged(pipe: Any) -> None:
    loop = StepLoop(SD3Steps(pipe), max_rows=2)  # one guided request per step
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
    loop.add(first.request_id, first)
    assert diff(run(loop)["r30"].image, qwen_alone(first)) == 0
    longer = DiffusionRequest(request_id="r33", prompt="a much longer prompt about a red fox in the snow at dusk",
                              seed=133, height=64, width=64, num_inference_steps=4, guidance_scale=3.0)  # fmt: skip
    mixed = [request(31, steps=5, guidance=3.0), request(32, steps=3, guidance=1.0), longer]
    for r in mixed:
        loop.add(r.request_id, r)
    done = run(loop)
    for r in mixed:
        assert done[r.request_id].image.std() > 5
        assert diff(done[r.request_id].image, qwen_alone(r)) <= 1, r.request_id
