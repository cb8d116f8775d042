"""The stage runtime end to end on the tiny GLM-Image: AR in a vLLM EngineCore process, DiT in a
StageDiffusionCoreProc (or in-process), shared-memory connectors, compared with the diffusers reference."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import our_segments, source_image
from vllm_omni_plugin.entrypoints.omni import Omni
from vllm_omni_plugin.stage.errors import QuarantinedError
from vllm_omni_plugin.stage.orchestrator import OmniRequest
from vllm_omni_testkit.reference.glm_image import glm_image_reference_image

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
        pids = {os.getpid(), *(p for c in o._async.pools[1].clients for p in c.processes.members)}
    assert our_segments(pids) == []  # shutdown released every shared-memory segment (other users' aside)


def request(prompt: str, size: int = 64, **kwargs) -> OmniRequest:
    kwargs.setdefault("num_inference_steps", STEPS)
    return OmniRequest(prompt=prompt, height=size, width=size, seed=0, sampling_params=GREEDY, **kwargs)


@functools.cache
def reference(model: Path, prompt: str, size: int, *, edit: bool = False) -> np.ndarray:
    """diffusers' own GLM-Image for the request, computed once for the tests that compare with it (an
    edit: of ``source_image()``)."""
    from PIL import Image

    images = [Image.fromarray(source_image())] if edit else None
    return glm_image_reference_image(str(model), prompt, size, size, images=images, seed=0,
                                     num_inference_steps=STEPS, guidance_scale=1.5)  # fmt: skip


def assert_same_image(ours: np.ndarray, reference: np.ndarray) -> None:
    assert ours.shape == reference.shape and ours.dtype == np.uint8
    assert int(np.abs(ours.astype(int) - reference.astype(int)).max()) <= 1  # <= 1/255


@pytest.mark.parametrize("size", [64, 128])
def test_text_to_image_equals_diffusers_reference(omni: Omni, tiny_glm_image: Path, size: int) -> None:
    (result,) = omni.generate([request("A photo of a cat", size)])
    assert result.ok, result.error
    assert_same_image(result.output.image, reference(tiny_glm_image, "A photo of a cat", size))
    assert omni.deployment.stage(1).process  # the DiT ran in a StageDiffusionCoreProc
    # per-request stage timings: queue, AR, processors, transfers (connector put/get), DiT
    for key in ("queue", "stage_0", "processor_1", "stage_1", "stage_1_transfer_put", "stage_1_transfer_in",
                "stage_1_transfer_out", "stage_1_denoise", "stage_1_decode", "total"):  # fmt: skip
        assert key in result.timings, (key, result.timings)


def test_image_to_image_equals_diffusers_reference(omni: Omni, tiny_glm_image: Path) -> None:

    (result,) = omni.generate([request("make it blue", images=[source_image()])])
    assert result.ok, result.error
    assert_same_image(result.output.image, reference(tiny_glm_image, "make it blue", 64, edit=True))


def test_concurrent_requests_overlap_stages(omni: Omni) -> None:
    results = omni.generate([request(f"a red fox number {i}") for i in range(8)])
    assert all(r.ok for r in results), [r.error for r in results]
    ar = [(iv.start, iv.end) for r in results for iv in r.intervals if iv.stage_id == 0]
    dit = [(iv.start, iv.end) for r in results for iv in r.intervals if iv.stage_id == 1]
    assert len(ar) == len(dit) == 8
    # some request's DiT work ran while another request's AR work was still going on
    assert any(d0 < a1 and a0 < d1 for (d0, d1) in dit for (a0, a1) in ar), (ar, dit)


def test_a_request_that_kills_the_diffusion_proc_every_time_fails_after_its_budget(omni: Omni) -> None:
    """The DiT process is SIGKILLed whenever the request reaches it: it runs again once (max_retries 1),
    alone, on the restarted process, then fails as the culprit (quarantined); the stage keeps serving."""
    (client,) = omni._async.pools[1].clients
    restarts = client.restarts
    poison = request("a painting that kills its painter", num_inference_steps=400)
    future = omni.submit(poison)
    killed: list[int] = []
    deadline = time.monotonic() + 240
    while not future.done():
        assert time.monotonic() < deadline, "the request never finished"
        pid = client.manager.pid
        if poison.request_id in client.inflight and pid is not None and pid not in killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        time.sleep(0.01)
    result = future.result()
    assert len(killed) == 2 and not result.ok
    assert "stage 1's process died while running this request alone" in result.error
    assert "2 deaths, max_retries 1" in result.error
    assert isinstance(result.exception, QuarantinedError)
    assert result.error_stage == 1 and len(result.deaths) == 2
    (after,) = omni.generate([request("a calm lake")])
    assert after.ok, after.error
    assert client.restarts == restarts + 2 and client.manager.pid not in killed


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
    from vllm_omni_plugin.stage.diffusion_core_client import InlineStageDiffusionClient

    assert isinstance(inline_omni._async.pools[1].clients[0], InlineStageDiffusionClient)
    src = source_image()
    t2i, i2i = inline_omni.generate([request("A photo of a cat"), request("make it blue", images=[src])])
    assert t2i.ok and i2i.ok, (t2i.error, i2i.error)
    assert_same_image(t2i.output.image, reference(tiny_glm_image, "A photo of a cat", 64))
    assert_same_image(i2i.output.image, reference(tiny_glm_image, "make it blue", 64, edit=True))
