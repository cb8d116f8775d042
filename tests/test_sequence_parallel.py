"""Sequence parallelism (``diffusion/sequence_parallel.py``) over two processes with gloo, on the tiny SD3,
FLUX, Qwen-Image and GLM-Image (two heads each: Ulysses attention, rank 0 attending with one head over
the text and the whole image): every image equals the single-process engine's within one level of 255
(each rank projects its own tokens: a matmul over other rows may round differently); rank 0's blocks
see half of each forward's image tokens (counted at its first block); an SD3 of one head (which two ranks
cannot split) gathers keys and values instead, to the same image; a forward the ranks cannot share (a
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
from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, sequence_parallel
from vllm_omni_plugin.diffusion.blocks import CompileSpec
from vllm_omni_plugin.diffusion.diffusers_runner import denoiser_of
from vllm_omni_plugin.diffusion.sequence_parallel import attention_method, sequence_plan
from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec, fixed_plan

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow]

STEPS = 4
TOKENS_64 = (64 // 16) ** 2
"""Image tokens of a 64x64 request (SD3, FLUX, Qwen-Image): latents of 8x8 in patches of 2."""


class Engines:
    """A family's single-process engine and its two sequence-parallel ranks, loaded once; the image
    tokens rank 0's first block takes in each forward, recorded by its forward."""

    def __init__(self, model: Path) -> None:
        self.plain = DiffusionEngine(model, DiffusionEngineConfig(max_batch_size=4))
        self.parallel = DiffusionEngine(
            model, DiffusionEngineConfig(max_batch_size=4, sequence_parallel_size=2)
        )
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
        return self.parallel.context.parallel_denoiser.split_calls

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


@pytest.fixture
def attentions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(heads, query tokens, key tokens) of every attention rank 0 computes inside a sequence-parallel
    forward (torch's ``scaled_dot_product_attention``, which SD3 calls and diffusers' dispatch ends in)."""
    import torch

    seen: list[tuple[int, int, int]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(sequence_parallel._current, "exchange", None) is not None:
            seen.append((int(query.shape[1]), int(query.shape[2]), int(key.shape[2])))
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def assert_ulysses(attentions: list[tuple[int, int, int]]) -> None:
    """Every attention rank 0 computed had one of the two heads and queries over the text and the whole
    image (keys gathered instead would leave it two heads and half the image's queries)."""
    assert attentions
    assert {heads for heads, _q, _k in attentions} == {1}
    assert all(queries == keys > TOKENS_64 for _h, queries, keys in attentions), set(attentions)


def _images(results: list[Any]) -> list[np.ndarray]:
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.image for r in results]


CALLS_PER_STEP = {"sd3": 1, "flux": 1, "qwen_image": 2}
"""Denoiser calls a guided step makes: SD3 batches its guidance pair; FLUX embeds guidance; Qwen-Image
calls once per branch."""


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image"])
def test_a_sequence_parallel_engine_gives_the_single_process_images(
    families: dict[str, Engines], family: str, attentions: list[tuple[int, int, int]]
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
    assert_ulysses(attentions)


def test_the_step_loops_forwards_share_their_tokens(
    engines: Engines, attentions: list[tuple[int, int, int]]
) -> None:
    """Sequence parallelism as a layer of the step loop: requests joining mid-way (one unguided, leaving
    early) share forwards whose image tokens are cut over the ranks, each with the image its whole call
    gives alone in one process (within 1/255)."""
    from test_cfg_parallel import loop_images

    first = ask("sp-loop-0", seed=40, steps=STEPS)
    late = [ask("sp-loop-1", seed=41, steps=STEPS), ask("sp-loop-2", seed=42, steps=2, guidance=1.0)]
    expected = {r.request_id: _images(engines.plain.generate([r]))[0] for r in (first, *late)}
    engines.tokens.clear()
    before = engines.split_calls
    got = loop_images(engines.parallel, first, late)
    for request_id, image in expected.items():
        assert_within_one_level(got[request_id], image)
    # one forward a step, each over the group with half the tokens: the first's 2 steps alone, its 2
    # beside the others, then the second request's last 2
    assert engines.split_calls - before == 6 and engines.tokens == [TOKENS_64 // 2] * 6
    assert_ulysses(attentions)


def test_an_edit_shares_its_noise_and_source_image_tokens(
    families: dict[str, Engines], attentions: list[tuple[int, int, int]]
) -> None:
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
    assert_ulysses(attentions)


def test_glm_image_shares_text_to_image_and_an_edits_unconditional_calls(
    families: dict[str, Engines], attentions: list[tuple[int, int, int]]
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
    assert_ulysses(attentions)  # the edit's calls on rank 0 alone are no sequence-parallel forward


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


@pytest.fixture(scope="module")
def tiny_sd3_one_head(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny SD3 with a transformer of one head of 32 (two ranks cannot split its heads)."""
    import shutil

    import torch
    from diffusers import SD3Transformer2DModel

    from vllm_omni_plugin.tiny_models.components import seeded_init

    model = tmp_path_factory.mktemp("sd3-one-head") / "model"
    shutil.copytree(tiny_sd3, model, ignore=shutil.ignore_patterns("transformer"))
    config = dict(SD3Transformer2DModel.load_config(tiny_sd3 / "transformer"))
    config.update(num_attention_heads=1, attention_head_dim=32)
    transformer = SD3Transformer2DModel.from_config(config)
    seeded_init(transformer, torch.Generator().manual_seed(0))
    transformer.save_pretrained(model / "transformer")
    return model


def test_a_head_count_the_ranks_do_not_divide_gathers_keys_and_values(
    tiny_sd3_one_head: Path, attentions: list[tuple[int, int, int]]
) -> None:
    from diffusers import SD3Transformer2DModel

    plan = sequence_plan(SD3Transformer2DModel.from_pretrained(tiny_sd3_one_head, subfolder="transformer"))
    assert plan.heads == (1, 1) and attention_method(plan, 2) == "all-gather"
    assert attention_method(plan, 1) == "ulysses"
    engines = Engines(tiny_sd3_one_head)
    try:
        request = ask("sp-one-head", seed=5, steps=STEPS)
        expected = _images(engines.plain.generate([request]))
        got = _images(engines.parallel.generate([request]))
        assert_within_one_level(got[0], expected[0])
        assert engines.tokens == [TOKENS_64 // 2] * STEPS
    finally:
        engines.close()
    # rank 0's one head: its own half of the image's queries against every key
    assert attentions and all(
        heads == 1 and queries == keys - TOKENS_64 // 2 for heads, queries, keys in attentions
    ), set(attentions)


def _attention_rank(rank: int, size: int, port: int, heads: int, results: Any) -> None:
    """One rank of the test below: its tokens' attention by Ulysses and by K/V all-gather against its
    rows of the whole sequence's attention, for [text, image] and [image, text], with and without a key
    mask (the text padding of one row); puts the largest difference."""
    import datetime

    import torch
    import torch.distributed as dist

    from vllm_omni_plugin.diffusion.peer_group import gloo_group

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    group = gloo_group(
        dist.TCPStore("127.0.0.1", port, size + 1, False, timeout=timeout), rank, size, timeout
    )
    generator = torch.Generator().manual_seed(0)  # every rank draws the same whole sequence
    batch, text, image, dim = 2, 5, 4 * size, 8
    share = image // size
    qkv = [torch.randn(batch, text + image, heads, dim, generator=generator) for _ in range(3)]
    padded = torch.ones(batch, 1, 1, text + image, dtype=torch.bool)
    padded[0, ..., 3:text] = False

    def attend(q: Any, k: Any, v: Any, mask: Any) -> Any:
        flip = [x.transpose(1, 2) for x in (q, k, v)]
        return torch.nn.functional.scaled_dot_product_attention(*flip, attn_mask=mask).transpose(1, 2)

    def order(x: Any, dim: int, first: bool) -> Any:  # [text, image] as drawn, or [image, text]
        return x if first else torch.cat([x.narrow(dim, text, image), x.narrow(dim, 0, text)], dim)

    def own(x: Any, dim: int, first: bool) -> Any:  # the text and this rank's image tokens, in that order
        t, i = sequence_parallel._split(x, image, first, dim)
        return sequence_parallel._join(t, i.narrow(dim, rank * share, share), first, dim)

    worst = 0.0
    for first in (True, False):
        whole = [order(x, 1, first) for x in qkv]
        for mask in (None, order(padded, 3, first)):
            expected = own(attend(*whole, mask), 1, first)
            local_mask = None if mask is None else own(mask, 3, first)
            for ulysses in (True, False):
                exchange = sequence_parallel._Exchange(group, rank, size, share, first, ulysses)
                method = sequence_parallel._ulysses if ulysses else sequence_parallel._gathered
                got = method(attend, *(own(x, 1, first) for x in whole), local_mask, exchange)
                assert got.shape == expected.shape
                worst = max(worst, float((got - expected).abs().max()))
    results.put((rank, worst))


@pytest.mark.parametrize("size", [2, 3])
def test_ulysses_and_all_gather_give_each_rank_its_tokens_attention(spawn: Any, size: int) -> None:
    """Six heads, two or three to a rank: the exchanges keep heads and tokens in order (the tiny
    models' one head a rank would not show a mix-up of heads)."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, size + 1, True, timeout=timeout, wait_for_workers=False)
    results = spawn.Queue()
    ranks = [
        spawn.Process(target=_attention_rank, args=(r, size, store.port, 6, results)) for r in range(size)
    ]
    for process in ranks:
        process.start()
    try:
        worst = dict(results.get(timeout=120) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=30)
    assert worst == {rank: 0.0 for rank in range(size)}


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
        DiffusionEngine(tiny_bagel, DiffusionEngineConfig(sequence_parallel_size=2, runner_cls=BAGEL_RUNNER))


def test_compiled_blocks_and_sequence_parallelism_refuse_each_other(tiny_sd3: Path) -> None:
    with pytest.raises(ValueError, match="sequence_parallel_size: compiled blocks would trace its exchanges"):
        DiffusionEngine(
            tiny_sd3, DiffusionEngineConfig(sequence_parallel_size=2, compile=CompileSpec(blocks=True))
        )
    with pytest.raises(ValueError, match="cfg_parallel_size and sequence_parallel_size cannot be combined"):
        DiffusionEngine(tiny_sd3, DiffusionEngineConfig(sequence_parallel_size=2, cfg_parallel_size=2))
