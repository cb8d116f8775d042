"""The stage runtime end to end on the tiny GLM-Image: AR in a vLLM EngineCore process, DiT in a
StageDiffusionCoreProc (or in-process), shared-memory connectors, compared with the diffusers reference."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import our_segments, source_image
from vllm_omni_plugin.entrypoints.omni import Omni
from vllm_omni_plugin.stage.orchestrator import OmniRequest
from vllm_omni_plugin.testing.glm_image_reference import glm_image_reference_image

REPO = Path(__file__).resolve().parent.parent
DEPLOY = str(REPO / "deploy" / "tiny_glm_image_cpu.yaml")
STEPS = 4
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def omni(tiny_glm_image: Path):
    # max_num_seqs 2: the AR stage decodes in small batches, so DiT work on earlier requests overlaps
    # AR work on later ones.
    with Omni(str(tiny_glm_image), deploy_config=DEPLOY, stage_overrides={"0": {"max_num_seqs": 2}}) as o:
        yield o
    assert our_segments() == []  # shutdown released every shared-memory segment


def request(prompt: str, size: int = 64, **kwargs) -> OmniRequest:
    kwargs.setdefault("num_inference_steps", STEPS)
    return OmniRequest(prompt=prompt, height=size, width=size, seed=0, sampling_params=GREEDY, **kwargs)


def assert_same_image(ours: np.ndarray, reference: np.ndarray) -> None:
    assert ours.shape == reference.shape and ours.dtype == np.uint8
    assert int(np.abs(ours.astype(int) - reference.astype(int)).max()) <= 1  # <= 1/255


@pytest.mark.parametrize("size", [64, 128])
def test_text_to_image_equals_diffusers_reference(omni: Omni, tiny_glm_image: Path, size: int) -> None:
    (result,) = omni.generate([request("A photo of a cat", size)])
    assert result.ok, result.error
    reference = glm_image_reference_image(str(tiny_glm_image), "A photo of a cat", size, size, seed=0,
                                          num_inference_steps=STEPS, guidance_scale=1.5)  # fmt: skip
    assert_same_image(result.output.image, reference)
    assert omni.deployment.stage(1).process  # the DiT ran in a StageDiffusionCoreProc
    # per-request stage timings: queue, AR, processors, transfers (connector put/get), DiT
    for key in ("queue", "stage_0", "processor_1", "stage_1", "stage_1_transfer_put", "stage_1_transfer_in",
                "stage_1_transfer_out", "stage_1_denoise", "stage_1_decode", "total"):  # fmt: skip
        assert key in result.timings, (key, result.timings)


def test_image_to_image_equals_diffusers_reference(omni: Omni, tiny_glm_image: Path) -> None:
    from PIL import Image

    src = source_image()
    (result,) = omni.generate([request("make it blue", images=[src])])
    assert result.ok, result.error
    reference = glm_image_reference_image(str(tiny_glm_image), "make it blue", 64, 64, images=[Image.fromarray(src)],
                                          seed=0, num_inference_steps=STEPS, guidance_scale=1.5)  # fmt: skip
    assert_same_image(result.output.image, reference)


def test_concurrent_requests_overlap_stages(omni: Omni) -> None:
    results = omni.generate([request(f"a red fox number {i}") for i in range(8)])
    assert all(r.ok for r in results), [r.error for r in results]
    ar = [(iv.start, iv.end) for r in results for iv in r.intervals if iv.stage_id == 0]
    dit = [(iv.start, iv.end) for r in results for iv in r.intervals if iv.stage_id == 1]
    assert len(ar) == len(dit) == 8
    # some request's DiT work ran while another request's AR work was still going on
    assert any(d0 < a1 and a0 < d1 for (d0, d1) in dit for (a0, a1) in ar), (ar, dit)


def test_dead_diffusion_proc_fails_its_request_and_restarts(omni: Omni) -> None:
    pool = omni._async.pools[1]
    (client,) = pool.clients
    restarts, old_pid = client.restarts, client.manager.pid
    slow = request("a very slow painting", num_inference_steps=400)
    future = omni.submit(slow)
    deadline = time.monotonic() + 120
    while slow.request_id not in client.inflight:
        assert time.monotonic() < deadline and not future.done(), "the request never reached the DiT"
        time.sleep(0.01)
    os.kill(old_pid, signal.SIGKILL)
    result = future.result(timeout=120)
    assert not result.ok
    assert "died" in result.error and "stage 1 (dit)" in result.error
    assert result.error_stage == 1
    (after,) = omni.generate([request("a calm lake")])
    assert after.ok, after.error
    assert client.restarts == restarts + 1 and client.manager.pid != old_pid


def test_bad_request_fails_alone(omni: Omni) -> None:
    results = omni.generate([request("too small", size=16), request("fine")])
    assert not results[0].ok and "64" not in (results[0].error or "")  # the size error, not a crash
    assert "32" in results[0].error
    assert results[1].ok, results[1].error


@pytest.fixture(scope="module")
def inline_omni(tiny_glm_image: Path, omni: Omni):
    with Omni(str(tiny_glm_image), deploy_config=DEPLOY, stage_overrides={"1": {"process": False}}) as o:
        yield o


def test_inline_diffusion_client_gives_the_same_images(inline_omni: Omni, tiny_glm_image: Path) -> None:
    from PIL import Image

    from vllm_omni_plugin.stage.diffusion_core_client import InlineStageDiffusionClient

    assert isinstance(inline_omni._async.pools[1].clients[0], InlineStageDiffusionClient)
    src = source_image()
    t2i, i2i = inline_omni.generate([request("A photo of a cat"), request("make it blue", images=[src])])
    assert t2i.ok and i2i.ok, (t2i.error, i2i.error)
    ref_t2i = glm_image_reference_image(str(tiny_glm_image), "A photo of a cat", 64, 64, seed=0,
                                        num_inference_steps=STEPS, guidance_scale=1.5)  # fmt: skip
    ref_i2i = glm_image_reference_image(str(tiny_glm_image), "make it blue", 64, 64, images=[Image.fromarray(src)],
                                        seed=0, num_inference_steps=STEPS, guidance_scale=1.5)  # fmt: skip
    assert_same_image(t2i.output.image, ref_t2i)
    assert_same_image(i2i.output.image, ref_i2i)
