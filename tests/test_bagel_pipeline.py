"""BAGEL end to end through the offline API against the independent reference.

One deployment for the module (``deploy/tiny_bagel_cpu.yaml``): the thinker in a vLLM EngineCore
process with the Omni scheduler and worker, the DiT in a StageDiffusionCoreProc running our BAGEL
generation runner, contexts over shared memory. The reference (``vllm_omni_testkit/reference/bagel.py``) runs
BAGEL's ``interleave_inference`` in this process, sharing no model code with the stages.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import our_segments_left
from vllm_omni_plugin.entrypoints.omni import Omni
from vllm_omni_plugin.stage.orchestrator import OmniRequest
from vllm_omni_testkit.harness.leaks import LeakWatch

REPO = Path(__file__).resolve().parent.parent
DEPLOY = str(REPO / "deploy" / "tiny_bagel_cpu.yaml")
STEPS = 8  # the deploy config's num_inference_steps
T2I = {"cfg_text_scale": 4.0, "cfg_img_scale": 1.0, "cfg_interval": (0.4, 1.0), "cfg_renorm_type": "global"}
EDIT = {
    "cfg_text_scale": 4.0,
    "cfg_img_scale": 2.0,
    "cfg_interval": (0.0, 1.0),
    "cfg_renorm_type": "text_channel",
}


def source_image(seed: int = 0, height: int = 64, width: int = 48) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def omni(tiny_bagel: Path):
    watch = LeakWatch().start()  # this process and its children
    with Omni(str(tiny_bagel), deploy_config=DEPLOY) as o:
        yield o
    assert our_segments_left(watch) == []  # shutdown released every shared-memory segment


@pytest.fixture(scope="module")
def reference(tiny_bagel: Path) -> Any:
    from vllm_omni_testkit.reference.bagel import BagelReference

    return BagelReference(str(tiny_bagel))


def assert_same_image(ours: np.ndarray, reference: np.ndarray) -> None:
    assert ours.shape == reference.shape and ours.dtype == np.uint8
    diff = np.abs(ours.astype(int) - reference.astype(int))
    assert diff.max() <= 2 and diff.mean() <= 0.1, (diff.max(), diff.mean())  # 2/255 and 0.1/255


def generate(omni: Omni, *requests: OmniRequest) -> list[Any]:
    results = omni.generate(list(requests))
    for result in results:
        assert result.ok, result.error
    return results


def test_text_to_image_equals_reference(omni: Omni, reference: Any) -> None:
    (result,) = generate(omni, OmniRequest(prompt="a red fox in the snow", height=64, width=64, seed=3))
    expected = reference.interleave(
        ["a red fox in the snow"], height=64, width=64, seed=3, num_inference_steps=STEPS, **T2I
    )
    assert_same_image(result.output.image, expected.image)


def test_edit_equals_reference(omni: Omni, reference: Any) -> None:
    image = source_image()
    (result,) = generate(omni, OmniRequest(prompt="make the sky blue", images=[image], seed=5))
    expected = reference.interleave([image, "make the sky blue"], seed=5, num_inference_steps=STEPS, **EDIT)
    assert result.output.image.shape == (expected.height, expected.width, 3)
    assert_same_image(result.output.image, expected.image)


def test_wrapped_prompt_is_not_wrapped_twice(omni: Omni) -> None:
    plain, wrapped = generate(
        omni,
        OmniRequest(prompt="a red fox", height=64, width=64, seed=1),
        OmniRequest(prompt="<|im_start|>a red fox<|im_end|>", height=64, width=64, seed=1),
    )
    assert np.array_equal(plain.output.image, wrapped.output.image)


def test_understanding_greedy_tokens_equal_reference(omni: Omni, reference: Any) -> None:
    image = source_image(2)
    (result,) = generate(
        omni,
        OmniRequest(
            prompt="what is in the picture",
            images=[image],
            modality="text",
            sampling_params={"max_tokens": 24},
        ),
    )
    expected = reference.interleave(
        [image, "what is in the picture"], understanding=True, max_think_token_n=25
    )
    assert result.output.token_ids[: len(expected.text_ids)] == expected.text_ids
    assert len(result.output.token_ids) >= len(expected.text_ids)


def test_think_mode_equals_reference(omni: Omni, reference: Any) -> None:
    """The thinker writes its plan, the plan joins cond (decoded and encoded again), then the image."""
    (result,) = generate(
        omni,
        OmniRequest(
            prompt="a red fox",
            height=64,
            width=64,
            seed=4,
            generation_params={"think": True, "max_think_tokens": 12},
        ),
    )
    expected = reference.interleave(
        ["a red fox"],
        think=True,
        max_think_token_n=12,
        height=64,
        width=64,
        seed=4,
        num_inference_steps=STEPS,
        **T2I,
    )
    assert result.notes["think_text"] == expected.text
    assert_same_image(result.output.image, expected.image)


def test_cfg_is_alive(omni: Omni) -> None:
    """Text guidance changes the image, and so does the prompt (the contexts reach the DiT)."""
    base = {"height": 64, "width": 64, "seed": 7}
    off, on, other = generate(
        omni,
        OmniRequest(prompt="a red fox", generation_params={"cfg_text_scale": 1.0}, **base),
        OmniRequest(prompt="a red fox", generation_params={"cfg_text_scale": 4.0}, **base),
        OmniRequest(prompt="a blue lake at sunset", generation_params={"cfg_text_scale": 4.0}, **base),
    )
    assert np.abs(off.output.image.astype(int) - on.output.image.astype(int)).mean() > 1.0
    assert np.abs(on.output.image.astype(int) - other.output.image.astype(int)).mean() > 1.0


def test_negative_prompt_is_a_companion_context(omni: Omni) -> None:
    base = {"prompt": "a red fox", "height": 64, "width": 64, "seed": 2}
    plain, negative = generate(omni, OmniRequest(**base), OmniRequest(negative_prompt="blurry, dark", **base))
    assert np.abs(plain.output.image.astype(int) - negative.output.image.astype(int)).mean() > 0.5


# --- what stage 1 receives ---------------------------------------------------------------------------


def _received_contexts(omni: Omni, request: OmniRequest) -> Any:
    """Run the thinker stage for ``request`` the way the orchestrator does (completed by the input
    processor, its processors, its replica pool), then read the DiT request's contexts through a connector
    of the edge's spec, as the DiT process does, and let the generation runner resolve the shared ones."""
    import asyncio

    import msgspec

    from vllm_omni_plugin.connectors.base import make_connector
    from vllm_omni_plugin.families.bagel.processors import continue_thinker, request2thinker, thinker2dit
    from vllm_omni_plugin.families.bagel.runner import BagelGenerationRunner
    from vllm_omni_plugin.stage.orchestrator import ProcessorContext
    from vllm_omni_plugin.stage.payload import internalize

    deployment = omni.deployment
    inner = omni._async  # the running AsyncOmni
    assert inner.orchestrator is not None
    request = asyncio.run_coroutine_threadsafe(inner.process(request), omni._loop).result()
    context = ProcessorContext(deployment.model, deployment, 0, request)

    async def thinker() -> Any:
        output = await inner.pools[0].generate(request2thinker({}, context))
        while (more := continue_thinker(output, context)) is not None:
            output = await inner.pools[0].generate(more)
        return output

    output = asyncio.run_coroutine_threadsafe(thinker(), omni._loop).result()
    dit_request = thinker2dit({0: output}, ProcessorContext(deployment.model, deployment, 1, request))
    spec = deployment.connectors[deployment.edge(0, 1).connector]
    with make_connector("reader", spec.name, dict(spec.extra)) as reader:
        fields = internalize(msgspec.to_builtins(dit_request.diffusion), reader)
        received = msgspec.convert(fields, BagelGenerationRunner.request_type)
        prepared = BagelGenerationRunner.shared_contexts(received)
        return {name: getattr(prepared, name) for name in ("cond", "cfg_text", "cfg_img")}


def _assert_received(received: dict[str, Any], expected: dict[str, Any]) -> None:
    for name, ctx in expected.items():
        got = received[name]
        assert (got.kv_len, got.rope) == (ctx.kv_len, ctx.rope), name
        if ctx.kv_len:
            diff = (got.kv - ctx.kv()).abs().max().item()
            assert diff <= 1e-4, (name, diff)


@pytest.mark.parametrize("kind", ["t2i", "edit", "negative", "think"])
def test_stage1_receives_the_reference_contexts(omni: Omni, reference: Any, kind: str) -> None:
    """All three contexts, for every way the thinker obtains them: the main request, an empty context,
    ``cond`` itself, a prefix of ``cond``, and companion requests (edit, negative prompt)."""
    image = source_image(4)
    requests = {
        "t2i": OmniRequest(prompt="a red fox", height=64, width=64, seed=0),
        "edit": OmniRequest(prompt="make it blue", images=[image], seed=0),
        "negative": OmniRequest(prompt="make it blue", images=[image], negative_prompt="dark", seed=0),
        "think": OmniRequest(
            prompt="a red fox", generation_params={"think": True, "max_think_tokens": 6}, seed=0
        ),
    }
    received = _received_contexts(omni, requests[kind])
    new = reference.new_context
    if kind == "t2i":
        cond = reference.add_text(new(), "a red fox")
        expected = {"cond": cond, "cfg_text": new(), "cfg_img": cond}
    elif kind in ("edit", "negative"):
        with_image = reference.add_image(new(), reference.vae_transform.resize(image))
        negative = reference.add_text(with_image, "dark")
        expected = {
            "cond": reference.add_text(with_image, "make it blue"),
            "cfg_text": negative if kind == "negative" else with_image,
            "cfg_img": reference.add_text(new(), "make it blue"),
        }
    else:
        result = reference.interleave(["a red fox"], think=True, max_think_token_n=6, num_inference_steps=2)
        expected = {"cond": result.cond, "cfg_text": result.cfg_text, "cfg_img": result.cfg_img}
    _assert_received(received, expected)


def test_stages_overlap(omni: Omni) -> None:
    """While the DiT denoises an early request, the thinker builds the contexts of later ones."""
    import concurrent.futures

    slow = omni.submit(OmniRequest(prompt="slow", height=64, width=64, seed=1, num_inference_steps=1000))
    deadline = time.monotonic() + 60
    while omni._async.pools[1].queue_depth == 0:  # until the DiT has it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    later = [omni.submit(OmniRequest(prompt=f"later {i}", height=64, width=64, seed=i)) for i in range(4)]
    results = [f.result() for f in concurrent.futures.as_completed([slow, *later])]
    assert all(r.ok for r in results), [r.error for r in results]
    first = slow.result()
    denoise = next(i for i in first.intervals if i.stage_id == 1)
    thinking = [i for r in results if r is not first for i in r.intervals if i.stage_id == 0]
    assert any(denoise.start < t.start and t.end < denoise.end for t in thinking), (denoise, thinking)


def test_the_deploy_configs_settings_and_steps_reach_the_request_before_stage_0(
    tiny_bagel: Path, tmp_path: Path
) -> None:
    """The input processor gives a request the deploy config's BAGEL settings and step count where it set
    none, the authors' defaults under them; the processors read the complete request alone."""
    import asyncio
    from types import SimpleNamespace

    from vllm_omni_plugin.config import PLATFORMS, resolve_deployment
    from vllm_omni_plugin.families.bagel.processors import dit_sampling, thinks
    from vllm_omni_plugin.stage.input_processor import InputProcessor

    path = tmp_path / "deploy.yaml"
    path.write_text(
        f"base_config: {DEPLOY}\nstages:\n  - stage_id: 1\n    num_inference_steps: 6\n"
        "    default_sampling_params: {think: true, cfg_text_scale: 3.0}\n"
    )
    deployment = resolve_deployment(str(tiny_bagel), deploy_config=str(path), platform=PLATFORMS["cpu"])
    inputs = InputProcessor(deployment)

    plain = asyncio.run(inputs.process(OmniRequest(prompt="a fox")))
    assert plain.num_inference_steps == 6
    assert (plain.settings.think, plain.settings.cfg_text_scale) == (True, 3.0)
    context = SimpleNamespace(request=plain, stage_id=1)
    assert thinks(context)
    sampling = dit_sampling(context)
    assert (sampling.num_inference_steps, sampling.cfg_text_scale) == (6, 3.0)
    assert sampling.cfg_img_scale == 1.0  # the authors' text-to-image default, which nobody set
    edit = asyncio.run(inputs.process(OmniRequest(prompt="a fox", images=[source_image(64)])))
    assert (
        dit_sampling(SimpleNamespace(request=edit, stage_id=1)).cfg_img_scale == 2.0
    )  # the authors' edit one

    own = asyncio.run(
        inputs.process(OmniRequest(prompt="a fox", num_inference_steps=4, generation_params={"think": False}))
    )
    assert own.num_inference_steps == 4
    assert (own.settings.think, own.settings.cfg_text_scale) == (False, 3.0)
    assert not thinks(SimpleNamespace(request=own, stage_id=1))


def test_requests_the_thinker_cannot_hold_are_refused_naming_each_count(omni: Omni) -> None:
    """Before the thinker runs: the plan a think request may write counts with its prompt (vLLM would
    call the whole a prompt of that many tokens), and an answer needs room after a long prompt."""
    from vllm_omni_plugin.stage.errors import StageRequestError

    think = OmniRequest(prompt="a red fox", generation_params={"think": True, "max_think_tokens": 1000})
    long_chat = OmniRequest(prompt=" ".join(["fox"] * 1500), modality="text")
    fits = OmniRequest(prompt="a red fox", generation_params={"think": True, "max_think_tokens": 100})
    refused_think, refused_chat, served = omni.generate([think, long_chat, fits])
    for result in (refused_think, refused_chat):
        assert isinstance(result.exception, StageRequestError) and result.error_stage == 0, result.error
        assert "of the thinker's max_model_len 1024" in result.error
    assert "the plan (max_think_tokens 1000)" in refused_think.error
    assert re.search(r"prompt \d+ \+ the plan", refused_think.error)
    assert re.search(
        r"prompt 15\d\d \+ at least one answer token 1; the prompt alone leaves no room", refused_chat.error
    )
    assert served.ok, served.error
