"""Sequence parallelism (``diffusion/sequence_parallel.py``) over two processes with gloo, on the tiny SD3
(keys and values gathered at their projections), FLUX, Qwen-Image and GLM-Image (gathered after the rotary
embedding, at the attention call): every image equals the single-process engine's within one level of
255 (each rank projects its own tokens: a matmul over other rows may round differently); rank 0's blocks
see half of each forward's image tokens (counted at its first block); a forward the ranks cannot share (a
token count they do not divide, a hook inside the denoiser, a GLM-Image edit's cache) runs on rank 0
whole; denoisers without a plan, BAGEL, and compiled blocks refuse it at start-up in one line. A dead
peer and a served stage: test_cfg_parallel.py, for both kinds of group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from test_step_batching import ask, assert_within_one_level, glm_edit
from vllm_omni_plugin.diffusion import DiffusionEngine
from vllm_omni_plugin.diffusion.sequence_parallel import sequence_plan
from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec, fixed_plan
from vllm_omni_plugin.families.diffusers.runner import denoiser_of

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow]

STEPS = 4
TOKENS_64 = (64 // 16) ** 2
"""Image tokens of a 64x64 request (SD3, FLUX, Qwen-Image): latents of 8x8 in patches of 2."""


class Engines:
    """A family's single-process engine and its two sequence-parallel ranks, loaded once; the image
    tokens rank 0's first block takes in each forward, recorded by its forward."""

    def __init__(self, model: Path) -> None:
        self.plain = DiffusionEngine(model, max_batch_size=4)
        self.parallel = DiffusionEngine(model, max_batch_size=4, sequence_parallel_size=2)
        self.tokens: list[int] = []
        # A wrapped forward, not a hook: a hook inside the denoiser keeps its forwards on rank 0.
        self._first = denoiser_of(self.parallel.runner.pipe).transformer_blocks[0]
        forward = self._first.forward

        def counted(*args: Any, **kwargs: Any) -> Any:
            tokens = (
                kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            )  # GLM-Image: by position
            self.tokens.append(int(tokens.shape[1]))
            return forward(*args, **kwargs)

        self._first.forward = counted

    @property
    def split_calls(self) -> int:
        return self.parallel.runner.parallel_denoiser.split_calls

    def close(self) -> None:
        del self._first.forward
        self.plain.close()
        self.parallel.close()


@pytest.fixture(scope="module")
def families(request: pytest.FixtureRequest) -> Iterator[dict[str, Engines]]:
    loaded: dict[str, Engines] = {}

    class Lazy(dict):
        def __missing__(self, family: str) -> Engines:
            loaded[family] = Engines(request.getfixturevalue(f"tiny_{family}"))
            return loaded[family]

    yield Lazy()
    for engines in loaded.values():
        engines.close()


@pytest.fixture
def engines(families: dict[str, Engines]) -> Engines:
    return families["sd3"]


def _images(results: list[Any]) -> list[np.ndarray]:
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.image for r in results]


CALLS_PER_STEP = {"sd3": 1, "flux": 1, "qwen_image": 2}
"""Denoiser calls a guided step makes: SD3 batches its guidance pair; FLUX embeds guidance; Qwen-Image
calls once per branch."""


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image"])
def test_a_sequence_parallel_engine_gives_the_single_process_images(
    families: dict[str, Engines], family: str
) -> None:
    engines = families[family]
    batch = [
        ask("sp-0", seed=0, steps=STEPS, family=family),
        # a longer prompt: Qwen-Image's attention then masks the shorter one's text padding
        ask(
            "sp-1", seed=1, steps=STEPS, family=family, prompt="a small red house by a lake, at dawn, in oils"
        ),
    ]
    expected = _images(engines.plain.generate(batch))
    engines.tokens.clear()
    before = engines.split_calls
    got = _images(engines.parallel.generate(batch))
    for a, b in zip(got, expected, strict=True):
        assert_within_one_level(a, b)
    # every forward (both requests in one) went over the group, rank 0 with half the tokens
    calls = STEPS * CALLS_PER_STEP[family]
    assert engines.split_calls - before == calls
    assert engines.tokens == [TOKENS_64 // 2] * calls


def test_an_edit_shares_its_noise_and_source_image_tokens(families: dict[str, Engines]) -> None:
    """Qwen-Image-Edit's source image enters as tokens after the noise's: both are cut over the ranks."""
    from test_diffusers_runners import source_image

    engines = families["qwen_image_edit"]
    batch = [
        ask(f"sp-edit-{i}", seed=i, steps=STEPS, family="qwen_image_edit", images=[source_image(64, seed=i)])
        for i in range(2)
    ]
    expected = _images(engines.plain.generate(batch))
    engines.tokens.clear()
    got = _images(engines.parallel.generate(batch))
    for a, b in zip(got, expected, strict=True):
        assert_within_one_level(a, b)
    calls = STEPS * CALLS_PER_STEP["qwen_image"]
    # the pipeline resizes the source image to about a megapixel: 1024x1024, 4096 tokens after the noise's
    assert engines.tokens == [(TOKENS_64 + (1024 // 16) ** 2) // 2] * calls


def test_glm_image_shares_text_to_image_and_an_edits_unconditional_calls(
    families: dict[str, Engines],
) -> None:
    """GLM-Image's DiT (two calls a guided step): a text-to-image request's calls are all shared; an
    edit's conditional calls, which write or read its source image's cached keys and values, stay on
    rank 0 whole, and its unconditional ones (the cache skipped) are shared."""
    engines = families["glm_image"]
    edit = glm_edit("sp-glm-edit", seed=30, steps=STEPS)
    for request, tokens in (
        (ask("sp-glm", seed=31, steps=STEPS, family="glm_image"), [TOKENS_64 // 2] * (2 * STEPS)),
        # the first call writes the source image's cache; then each step reads it, and skips it
        (edit, [TOKENS_64] + [TOKENS_64, TOKENS_64 // 2] * STEPS),
    ):
        expected = _images(engines.plain.generate([request]))
        engines.tokens.clear()
        got = _images(engines.parallel.generate([request]))
        assert_within_one_level(got[0], expected[0])
        assert engines.tokens == tokens


def test_an_unguided_request_shares_its_tokens_too(engines: Engines) -> None:
    request = ask("sp-unguided", seed=7, steps=STEPS, guidance=1.0)
    expected = _images(engines.plain.generate([request]))
    engines.tokens.clear()
    got = _images(engines.parallel.generate([request]))
    assert_within_one_level(got[0], expected[0])
    assert engines.tokens == [TOKENS_64 // 2] * STEPS  # one row: CFG parallelism could not split it


def test_cached_requests_share_the_tokens_of_the_steps_they_compute(engines: Engines) -> None:
    fixed = StepCacheSpec(policy="fixed", warmup_steps=1, final_steps=0).resolved()
    computed = sum(fixed_plan(fixed, STEPS))
    assert computed < STEPS
    batch = [ask(f"sp-cached-{i}", seed=i, steps=STEPS, cache=fixed) for i in range(2)]
    expected = _images(engines.plain.generate(batch))
    engines.tokens.clear()
    got = _images(engines.parallel.generate(batch))
    for a, b in zip(got, expected, strict=True):
        assert_within_one_level(a, b)
    assert engines.tokens == [TOKENS_64 // 2] * computed  # the cached steps skip the forward whole


def test_a_token_count_the_ranks_do_not_divide_runs_on_rank_0(engines: Engines) -> None:
    request = ask("sp-odd", seed=3, steps=STEPS, height=48, width=48)  # 3x3 patches: 9 tokens
    expected = _images(engines.plain.generate([request]))
    engines.tokens.clear()
    before = engines.split_calls
    got = _images(engines.parallel.generate([request]))
    assert np.array_equal(got[0], expected[0])  # the same forward, on one process
    assert engines.tokens == [9] * STEPS
    assert engines.split_calls == before


def test_a_hook_inside_the_denoiser_keeps_its_forwards_on_rank_0(engines: Engines) -> None:
    """A LoRA adapter's hooks live in rank 0's denoiser only: such a forward is not shared."""
    module = denoiser_of(engines.parallel.runner.pipe)
    calls: list[int] = []
    hook = module.transformer_blocks[-1].register_forward_hook(lambda *_: calls.append(1))
    try:
        engines.tokens.clear()
        before = engines.split_calls
        _images(engines.parallel.generate([ask("sp-hooked", seed=4, steps=STEPS)]))
    finally:
        hook.remove()
    assert calls == [1] * STEPS
    assert engines.tokens == [TOKENS_64] * STEPS and engines.split_calls == before


def test_a_denoiser_without_a_sequence_plan_refuses_it(tiny_sd3: Path) -> None:
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny_sd3, subfolder="vae")
    with pytest.raises(ValueError) as caught:
        sequence_plan(vae)
    assert str(caught.value) == (
        "sequence parallelism covers FluxTransformer2DModel, GlmImageTransformer2DModel, "
        "QwenImageTransformer2DModel, SD3Transformer2DModel, not AutoencoderKL; remove sequence_parallel_size"
    )


def test_bagel_refuses_it_in_one_line(tiny_bagel: Path) -> None:
    from test_step_batching import BAGEL_RUNNER

    with pytest.raises(
        ValueError, match=r"sequence_parallel_size: .* cannot run sequence-parallel; remove it"
    ):
        DiffusionEngine(tiny_bagel, sequence_parallel_size=2, runner_cls=BAGEL_RUNNER)


def test_compiled_blocks_and_sequence_parallelism_refuse_each_other(tiny_sd3: Path) -> None:
    with pytest.raises(ValueError, match="sequence_parallel_size: compiled blocks would trace its exchanges"):
        DiffusionEngine(tiny_sd3, sequence_parallel_size=2, compile={"blocks": True})
    with pytest.raises(ValueError, match="cfg_parallel_size and sequence_parallel_size cannot be combined"):
        DiffusionEngine(tiny_sd3, sequence_parallel_size=2, cfg_parallel_size=2)
