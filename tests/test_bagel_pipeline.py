"""BAGEL end to end through the offline API against the independent reference.

One deployment for the module (``deploy/tiny_bagel_cpu.yaml``): the thinker in a vLLM EngineCore
process with the Omni scheduler and worker, the DiT in a StageDiffusionCoreProc running our BAGEL
generation runner, contexts over shared memory. The reference (``testing/bagel_reference.py``) runs
BAGEL's ``interleave_inference`` in this process, sharing no model code with the stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import our_segments
from vllm_omni_plugin.entrypoints.omni import Omni
from vllm_omni_plugin.stage.orchestrator import OmniRequest

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
    with Omni(str(tiny_bagel), deploy_config=DEPLOY) as o:
        yield o
    assert our_segments() == []  # shutdown released every shared-memory segment


@pytest.fixture(scope="module")
def reference(tiny_bagel: Path) -> Any:
    from vllm_omni_plugin.testing.bagel_reference import BagelReference

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
            think=True,
            generation_params={"max_think_tokens": 12},
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
