"""Step caching (``diffusion/step_cache.py``) in the diffusion engine, on tiny SD3, FLUX, Qwen-Image,
GLM-Image and BAGEL: off gives today's images bit for bit; a fixed policy runs exactly the denoiser block
evaluations it says (counted by hooks on the blocks, independently of the engine's own counters); cached
images stay within a stated distance of uncached ones; cached and uncached requests share batches, each
getting the image it gets alone; step-batched groups cache too.

The distance is stated, not judged: on random weights a tiny model's velocity changes from step to step
far more than a trained model's (that is what caching bets on), so these tests bound the mechanics, and
quality can only be judged on real weights."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from test_step_batching import BAGEL_RUNNER, ask, assert_within_one_level
from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig
from vllm_omni_plugin.diffusion.blocks import repeated_blocks
from vllm_omni_plugin.diffusion.diffusers_runner import denoiser_of
from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec, fixed_plan

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow]

STEPS = 12
FIXED = StepCacheSpec(policy="fixed")  # defaults: warm-up 2, one in 2, last 1
FIXED_STEPS = [0, 1, 2, 4, 6, 8, 10, 11]
"""The steps of 12 the fixed policy's defaults compute, written out (not derived from its code)."""
BAGEL_FIXED_STEPS = [0, 1, 2, 4, 6, 8, 10]
"""BAGEL's 12 steps are 11 intervals of its schedule (its ``num_timesteps`` counts both ends): the last
one computed is its 11th."""
CALLS_PER_STEP = {"sd3": 1, "flux": 1, "qwen_image": 2, "glm_image": 2}
"""Denoiser calls a guided step makes: SD3 batches its guidance pair, FLUX embeds guidance, Qwen-Image
(true CFG) and GLM-Image call twice."""
MEAN_LEVELS = 10.0
"""The stated distance: a cached image's mean absolute difference from the uncached one, in levels of
255 (measured on these models at 12 steps: 3.0-5.7)."""


class Engines:
    """Per family: an engine batching whole requests and, where asked, one batching steps; loaded once.
    Block evaluations are counted by forward hooks on the denoiser's blocks (BAGEL: calls of its
    velocity forward, times its layers)."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.request = request
        self.loaded: dict[tuple[str, str], DiffusionEngine] = {}
        self.blocks: dict[str, int] = {}
        self.evaluations: dict[str, list[int]] = {}

    def __call__(self, family: str, batching: str = "request") -> DiffusionEngine:
        key = (family, batching)
        if key not in self.loaded:
            model = self.request.getfixturevalue(f"tiny_{family}")
            runner = {"runner_cls": BAGEL_RUNNER} if family == "bagel" else {}
            engine = DiffusionEngine(
                model, DiffusionEngineConfig(max_batch_size=4, batching=batching, **runner)
            )
            self.loaded[key] = engine
            self._count(family, engine)
        return self.loaded[key]

    def _count(self, family: str, engine: DiffusionEngine) -> None:
        count = self.evaluations.setdefault(family, [0])
        if family == "bagel":
            model = engine.runner.transformer
            velocity = model.velocity
            self.blocks[family] = model.num_layers

            def counted(*args: Any, **kwargs: Any) -> Any:
                count[0] += model.num_layers
                return velocity(*args, **kwargs)

            model.velocity = counted
            return
        blocks = repeated_blocks(denoiser_of(engine.runner.pipe))
        self.blocks[family] = len(blocks)
        for block in blocks:
            block.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))

    def run(
        self, family: str, requests: list[Any], batching: str = "request"
    ) -> tuple[list[np.ndarray], int]:
        """The images of ``requests`` run as one batch (or one group), and the block evaluations."""
        engine = self(family, batching)
        count = self.evaluations[family]
        count[0] = 0
        if batching == "step":
            groups, failed = engine.admit(requests)
            assert not failed and len(groups) == 1
            results = engine.run_group(groups[0])
        else:
            results = engine.generate(requests)
        assert all(r.ok for r in results), [r.error for r in results]
        assert all(r.batch_size == len(requests) for r in results)
        return [r.image for r in results], count[0]


@pytest.fixture(scope="module")
def engines(request: pytest.FixtureRequest) -> Iterator[Engines]:
    loaded = Engines(request)
    yield loaded
    for engine in loaded.loaded.values():
        engine.close()


def make(family: str, request_id: str, seed: int, cache: StepCacheSpec | None = None, **kw: Any) -> Any:
    """A 64x64 request of ``family``, 12 steps, guided."""
    request = ask(request_id, seed, steps=STEPS, family=family, **kw)
    return msgspec.structs.replace(request, cache=cache)


def mean_levels(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


# --- settings ------------------------------------------------------------------------------------------


@pytest.mark.fast
def test_settings_resolve_field_by_field_and_bad_values_name_their_field() -> None:
    stage = StepCacheSpec(policy="fixed", compute_every=3)
    mine = StepCacheSpec(warmup_steps=4)
    resolved = mine.over(stage).resolved()
    assert (resolved.policy, resolved.compute_every, resolved.warmup_steps, resolved.final_steps) == (
        "fixed",
        3,
        4,
        1,
    )
    assert not StepCacheSpec(policy="none").over(stage).resolved().active
    assert not StepCacheSpec().resolved().active  # off unless a policy is named
    assert fixed_plan(FIXED, STEPS) == [step in FIXED_STEPS for step in range(STEPS)]
    assert fixed_plan(StepCacheSpec(policy="fixed", compute_every=3, warmup_steps=1, final_steps=0), 7) == [
        True,
        True,
        False,
        False,
        True,
        False,
        False,
    ]
    assert "one step in 3" in stage.describe()
    for bad, field in [({"policy": "sometimes"}, "policy"), ({"compute_every": 0}, "compute_every"),
                       ({"threshold": -1}, "threshold"), ({"warmup_steps": 0}, "warmup_steps"),
                       ({"steps": 3}, "steps")]:  # fmt: skip
        with pytest.raises(msgspec.ValidationError, match=field):
            msgspec.convert(bad, StepCacheSpec)


# --- the diffusers families and GLM-Image ---------------------------------------------------------------


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image", "glm_image"])
def test_a_fixed_policy_runs_the_blocks_it_says(engines: Engines, family: str) -> None:
    uncached, evaluations = engines.run(family, [make(family, "u", 5)])
    blocks, calls = engines.blocks[family], CALLS_PER_STEP[family]
    assert evaluations == blocks * calls * STEPS
    before = engines(family).counters()
    cached, evaluations = engines.run(family, [make(family, "c", 5, FIXED)])
    assert evaluations == blocks * calls * len(FIXED_STEPS)
    after = engines(family).counters()
    assert after.computed_blocks - before.computed_blocks == blocks * calls * len(FIXED_STEPS)
    assert after.cached_blocks - before.cached_blocks == blocks * calls * (STEPS - len(FIXED_STEPS))
    assert 0 < mean_levels(cached[0], uncached[0]) <= MEAN_LEVELS
    assert cached[0].std() > 10  # an image, not a constant
    # the same again: decisions and estimates are deterministic
    assert np.array_equal(engines.run(family, [make(family, "c2", 5, FIXED)])[0][0], cached[0])


@pytest.mark.parametrize("family", ["sd3", "qwen_image", "glm_image"])
def test_off_is_todays_image_bit_for_bit(
    engines: Engines, family: str, request: pytest.FixtureRequest
) -> None:
    """A stage whose cache block says ``fixed``, and a request that turns it off: the image of an engine
    that has no cache block at all."""
    model = request.getfixturevalue(f"tiny_{family}")
    cached_stage = DiffusionEngine(
        model, DiffusionEngineConfig(max_batch_size=4, cache=StepCacheSpec(policy="fixed"))
    )
    try:
        off = cached_stage.generate([make(family, "off", 7, StepCacheSpec(policy="none"))])[0]
        on = cached_stage.generate([make(family, "on", 7)])[0]
    finally:
        cached_stage.close()
    plain, _ = engines.run(family, [make(family, "plain", 7)])
    assert np.array_equal(off.image, plain[0])
    assert not np.array_equal(on.image, plain[0])  # the stage's policy applies where a request is silent


@pytest.mark.parametrize("family", ["sd3", "qwen_image", "glm_image"])
def test_cached_and_uncached_requests_share_a_batch(engines: Engines, family: str) -> None:
    """A fixed, an uncached and a threshold request in one batch: each gets the image it gets alone, and
    the cached requests' rows leave the forwards at their cached steps."""
    threshold = StepCacheSpec(policy="threshold", threshold=0.05)
    mixed = [make(family, "f", 1, FIXED), make(family, "n", 2), make(family, "t", 3, threshold)]
    alone = [engines.run(family, [request])[0][0] for request in mixed]
    together, evaluations = engines.run(family, mixed)
    for image, own in zip(together, alone, strict=True):
        assert_within_one_level(image, own)
    # the uncached request computes every step: every forward still runs, the cached rows less often
    assert evaluations == engines.blocks[family] * CALLS_PER_STEP[family] * STEPS


def test_a_threshold_policy_computes_at_least_every_max_cached_steps(engines: Engines) -> None:
    """A threshold no change reaches: the request computes its warm-up, then one step after each run of
    ``max_cached_steps`` cached ones, and its last."""
    never = StepCacheSpec(policy="threshold", threshold=1e9, max_cached_steps=3)
    _, evaluations = engines.run("sd3", [make("sd3", "t", 9, never)])
    computed = [0, 1, 5, 9, 11]  # cached: 2-4, 6-8, 10
    assert evaluations == engines.blocks["sd3"] * len(computed)
    _, evaluations = engines.run(
        "sd3", [make("sd3", "t0", 9, msgspec.structs.replace(never, threshold=1e-9))]
    )
    assert evaluations == engines.blocks["sd3"] * STEPS  # every change reaches it


def test_glm_image_edits_write_their_source_images_uncached(engines: Engines) -> None:
    """An edit's first denoiser call writes its source image's K/V: never cached, never a step."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    from test_step_batching import token_ids

    def edit(request_id: str, cache: StepCacheSpec | None) -> Any:
        return make(
            "glm_image",
            request_id,
            21,
            cache,
            images=[image],
            prior_token_image_ids=[token_ids(16, 121)],
            source_image_grid_thw=[[1, 4, 4]],
        )

    uncached, evaluations = engines.run("glm_image", [edit("u", None)])
    blocks = engines.blocks["glm_image"]
    assert evaluations == blocks * (1 + 2 * STEPS)
    cached, evaluations = engines.run("glm_image", [edit("c", FIXED)])
    assert evaluations == blocks * (1 + 2 * len(FIXED_STEPS))
    assert 0 < mean_levels(cached[0], uncached[0]) <= MEAN_LEVELS


# --- step batching ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["sd3", "bagel"])
def test_step_batched_groups_cache_as_whole_requests_do(engines: Engines, family: str) -> None:
    """A group's cached steps skip the shared forward; a group whose requests disagree at a step runs
    every row, the cached ones still taking their estimates: each image is the whole-request one."""
    cached = make(family, "c", 4, FIXED)
    whole, _ = engines.run(family, [cached])
    stepped, evaluations = engines.run(family, [cached], batching="step")
    assert_within_one_level(stepped[0], whole[0])
    computed = BAGEL_FIXED_STEPS if family == "bagel" else FIXED_STEPS
    assert evaluations == engines.blocks[family] * len(computed)
    pair = [cached, make(family, "n", 6)]
    together, evaluations = engines.run(family, pair, batching="step")
    for image, request in zip(together, pair, strict=True):
        assert_within_one_level(image, engines.run(family, [request])[0][0])
    assert evaluations == engines.blocks[family] * (STEPS - (family == "bagel"))


# --- BAGEL --------------------------------------------------------------------------------------------


def test_bagel_caches_its_guided_velocity(engines: Engines) -> None:
    """BAGEL's cached step skips its whole velocity forward (every branch); a batch of a cached and an
    uncached request gives each its own image."""
    engines("bagel")
    blocks = engines.blocks["bagel"]
    uncached, evaluations = engines.run("bagel", [make("bagel", "u", 3)])
    assert evaluations == blocks * (STEPS - 1)
    before = engines("bagel").counters()
    cached, evaluations = engines.run("bagel", [make("bagel", "c", 3, FIXED)])
    assert evaluations == blocks * len(BAGEL_FIXED_STEPS)
    saved = engines("bagel").counters().cached_blocks - before.cached_blocks
    assert saved == blocks * (STEPS - 1 - len(BAGEL_FIXED_STEPS))
    assert 0 < mean_levels(cached[0], uncached[0]) <= MEAN_LEVELS
    together, _ = engines.run("bagel", [make("bagel", "c", 3, FIXED), make("bagel", "u", 3)])
    assert_within_one_level(together[0], cached[0])
    assert_within_one_level(together[1], uncached[0])
