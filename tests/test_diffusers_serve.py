"""Any diffusers pipeline served end to end: ``vllm serve <tiny model> --omni`` with no deploy config,
through the stock ``vllm`` script, driven with the official ``openai`` client. For SD3, FLUX, Qwen-Image
and Qwen-Image-Edit, every served image equals a direct diffusers call with the same seed (at most 1/255
apart); the offline API does the same; what a model cannot do is a 400 that says so, and a model no runner
can drive stops ``vllm serve`` with one line and exit code 2. On the same servers, streamed answers: a
generation of the tiny SD3 with ``partial_images=2`` yields two previews and a completed image equal to the
same request not streamed; the same for an edit of the tiny Qwen-Image-Edit; a client that closes the stream
after its first preview has its request aborted (the DiT is held by a hold point meanwhile, so the test does
not depend on the machine's speed). The tiny GLM-Image's streams (its AR stage's progress first; chat's
image as a content part) are tested on the one GLM-Image server of ``test_api_server.py``."""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from helpers import assert_streamed, pixels, png_header, source_image
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.forks import VllmForks
from vllm_omni_testkit.harness.server import (
    ServerProcess,
    bin_script,
    cpu_test_env,
    free_port,
    wait_for_metric,
)
from vllm_omni_testkit.reference.diffusers import reference_image

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore::FutureWarning")]

STEPS = 4
FAMILIES = {
    # family: (guidance, edits images)
    "sd3": (3.0, False),
    "flux": (3.5, False),
    "qwen_image": (3.0, False),
    "qwen_image_edit": (2.5, True),
}


@dataclass
class Served:
    family: str
    model: Path
    server: ServerProcess
    client: openai.OpenAI
    guidance: float
    edits: bool

    @property
    def name(self) -> str:
        return f"tiny-{self.family}"

    def reference(
        self, prompt: str, seed: int, images: list[np.ndarray] | None = None, **more: Any
    ) -> np.ndarray:
        return reference_image(
            self.model,
            prompt=prompt,
            seed=seed,
            height=64,
            width=64,
            steps=STEPS,
            guidance=self.guidance,
            images=images,
            **more,
        )

    @property
    def sampling(self) -> dict[str, float]:
        return {"num_inference_steps": STEPS, "guidance_scale": self.guidance}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server per family at a time (the module's tests run family by family)."""
    family = request.param
    model = request.getfixturevalue(f"tiny_{family}")
    port = free_port()
    server = ServerProcess(
        [bin_script("vllm"), "serve", str(model), "--omni", "--port", str(port), "--host", "127.0.0.1",
         "--served-model-name", f"tiny-{family}"],
        port=port,
        log_path=tmp_path_factory.mktemp(f"serve_{family}") / "server.log",
    )  # fmt: skip
    with server:
        server.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300, max_retries=0)
        guidance, edits = FAMILIES[family]
        yield Served(family, model, server, client, guidance, edits)


def decode(b64: str) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image)


def png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def assert_within_one_level(served: np.ndarray, direct: np.ndarray) -> None:
    assert served.shape == direct.shape == (64, 64, 3)
    diff = np.abs(served.astype(np.int16) - direct.astype(np.int16))
    assert diff.max() <= 1, diff.max()
    assert served.std() > 10  # an image, not a constant (NaNs would come out as one)


# --- images equal to diffusers ---------------------------------------------------------------------------


def test_generations_equal_direct_diffusers_calls(served: Served) -> None:
    if served.edits:
        with pytest.raises(openai.BadRequestError) as caught:
            served.client.images.generate(prompt="a red fox", size="64x64", extra_body=served.sampling)
        assert "edits images and needs a source image" in str(caught.value)
        assert "QwenImageEditPipeline" in str(caught.value)
        return
    before = served.server.metric("omni_diffusion_denoise_steps_total")
    result = served.client.images.generate(
        model=served.name,
        prompt="a red fox in the snow",
        n=3,
        size="64x64",
        extra_body={**served.sampling, "seed": 11},
    )
    images = [decode(item.b64_json) for item in result.data]
    for i, image in enumerate(images):  # seeds 11, 12, 13; the three ran as one batch
        assert_within_one_level(image, served.reference("a red fox in the snow", seed=11 + i))
    assert len({image.tobytes() for image in images}) == 3
    assert served.server.metric("omni_diffusion_denoise_steps_total") - before == 3 * STEPS
    assert served.server.metric("omni_diffusion_weight_bytes", stage="0") > 0  # the replica's, as held


def test_a_request_without_size_gets_the_pipelines_own_default(served: Served) -> None:
    """Not 1024x1024 (the OpenAI default): the size diffusers itself gives a call without one, the same
    image. The tiny SD3's is 256x256 (its transformer's sample size times the VAE's scale); FLUX's and
    Qwen-Image's pipelines default to 1024x1024, which tells nothing here."""
    if served.family != "sd3":
        pytest.skip("only the tiny SD3's own default size differs from 1024x1024")
    result = served.client.images.generate(
        model=served.name, prompt="a red fox", extra_body={**served.sampling, "seed": 5}
    )
    image = decode(result.data[0].b64_json)
    direct = reference_image(
        served.model,
        prompt="a red fox",
        seed=5,
        height=None,
        width=None,
        steps=STEPS,
        guidance=served.guidance,
    )
    assert image.shape == direct.shape == (256, 256, 3)
    assert int(np.abs(image.astype(np.int16) - direct.astype(np.int16)).max()) <= 1


def test_a_priority_without_priority_scheduling_is_400_naming_the_field(served: Served) -> None:
    """vLLM's ``priority`` field: 0 is served; another value needs ``scheduling_policy: priority`` (the
    served step loop tests it there: ``test_step_loop_serve.py``)."""
    if served.family != "sd3":
        pytest.skip("checked on the tiny SD3")
    ask = {"model": served.name, "prompt": "a red fox", "size": "64x64"}
    served.client.images.generate(**ask, extra_body={**served.sampling, "seed": 3, "priority": 0})
    answer = http_client.post(
        served.server.base_url + "/v1/images/generations", json={**ask, "priority": 3}, timeout=60
    )
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "priority", error
    assert "set scheduling_policy: priority on its stages" in error["message"]


def test_a_size_the_pipeline_cannot_make_is_400_before_any_stage_runs(served: Served) -> None:
    """SD3's position embedding covers at most 1024x1024 for the tiny model (2048 is the server's own
    bound): 400 naming the model's limit, not the pipeline's ValueError as a 500."""
    if served.family != "sd3":
        pytest.skip("only SD3 states a largest side (its position embedding table)")
    steps = served.server.metric("omni_diffusion_denoise_steps_total")
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.images.generate(model=served.name, prompt="a red fox", size="2048x2048")
    assert caught.value.status_code == 400
    message = str(caught.value)
    assert "at most 1024 pixels for" in message and "StableDiffusion3Pipeline" in message, message
    assert served.server.metric("omni_diffusion_denoise_steps_total") == steps
    health = http_client.get(served.server.base_url + "/health", timeout=30).json()
    assert all(r["inflight"] == 0 for s in health["stages"].values() for r in s["replicas"])


def test_chat_with_image_modality_equals_a_direct_call(served: Served) -> None:
    content: str | list[dict] = "a small house on the shore"
    images = [source_image(64, seed=5)] if served.edits else None
    if images:
        uri = "data:image/png;base64," + base64.b64encode(png(images[0])).decode()
        content = [{"type": "text", "text": content}, {"type": "image_url", "image_url": {"url": uri}}]
    response = served.client.chat.completions.create(
        model=served.name,
        messages=[{"role": "user", "content": content}],
        extra_body={"modalities": ["image"], "size": "64x64", "seed": 3, **served.sampling},
    )
    parts = response.choices[0].message.content
    assert isinstance(parts, list) and parts[0]["type"] == "image_url"  # as vllm-omni's clients read it
    url = parts[0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    image = decode(url.removeprefix("data:image/png;base64,"))
    assert_within_one_level(image, served.reference("a small house on the shore", seed=3, images=images))


def test_edits_masked_edits_and_variations_equal_diffusers(served: Served) -> None:
    """Through the official client: an edit (a text-to-image model's on diffusers' image-to-image pipeline
    of its family), an edit with a mask (OpenAI's: transparent pixels are repainted; diffusers' inpainting
    pipeline) and a variation (the image redrawn with no prompt) each equal diffusers' own pipeline for the
    same seed. A bad mask is a 400 that says what is wrong."""
    source = source_image(64, seed=9)
    image = ("in.png", png(source), "image/png")
    result = served.client.images.edit(
        model=served.name,
        image=image,
        prompt="make it blue",
        size="64x64",
        extra_body={**served.sampling, "seed": 21},
    )
    assert_within_one_level(decode(result.data[0].b64_json), served.reference("make it blue", 21, [source]))

    rgba = np.dstack([source, np.full((64, 64), 255, np.uint8)])
    rgba[16:48, 8:40, 3] = 0  # transparent: repainted
    mask = np.where(rgba[..., 3] == 0, 255, 0).astype(np.uint8)
    if served.edits:  # Qwen-Image-Edit: no masks yet (its runner says why)
        with pytest.raises(openai.BadRequestError) as caught:
            served.client.images.edit(image=image, mask=("mask.png", png(rgba), "image/png"), prompt="x")
        assert "cannot repaint a masked area (it runs edits without a mask)" in str(caught.value)
    else:
        result = served.client.images.edit(
            image=image,
            mask=("mask.png", png(rgba), "image/png"),
            prompt="a red door",
            size="64x64",
            extra_body={**served.sampling, "seed": 22, "strength": 0.8},
        )
        direct = served.reference("a red door", 22, [source], mask=mask, strength=0.8)
        assert_within_one_level(decode(result.data[0].b64_json), direct)
        # in chat, the mask is an image_url part marked as such (at the pipeline's own strength)
        uri = "data:image/png;base64,"
        content = [
            {"type": "text", "text": "a red door"},
            {"type": "image_url", "image_url": {"url": uri + base64.b64encode(png(source)).decode()}},
            {
                "type": "image_url",
                "image_url": {"url": uri + base64.b64encode(png(rgba)).decode(), "mask": True},
            },
        ]
        response = served.client.chat.completions.create(
            model=served.name,
            messages=[{"role": "user", "content": content}],
            extra_body={"modalities": ["image"], "size": "64x64", "seed": 22, **served.sampling},
        )
        chat_image = decode(response.choices[0].message.content[0]["image_url"]["url"].removeprefix(uri))
        assert_within_one_level(chat_image, served.reference("a red door", 22, [source], mask=mask))

    if served.edits:  # the edit model's variation is its edit with no prompt: the edit above's path
        return
    result = served.client.images.create_variation(
        image=image, n=2, size="64x64", extra_body={**served.sampling, "seed": 23}
    )
    variations = [decode(item.b64_json) for item in result.data]
    for k, variation in enumerate(variations):
        assert_within_one_level(variation, served.reference("", 23 + k, [source]))
    assert not np.array_equal(*variations)
    if served.family != "sd3":
        return
    for mask_png, says in (
        (png(rgba[:32]), "a mask has the size of the image it marks"),
        (png(source), "has no alpha channel"),
        (png(np.dstack([source, np.full((64, 64), 255, np.uint8)])), "no fully transparent pixel"),
        (b"not an image", "cannot decode"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            served.client.images.edit(image=image, mask=("m.png", mask_png, "image/png"), prompt="x")
        assert says in str(caught.value) and caught.value.body["param"] == "mask", caught.value
    with pytest.raises(openai.APIStatusError) as caught:  # huge: refused from its header, never decoded
        served.client.images.edit(
            image=image, mask=("m.png", png_header(40000, 40000), "image/png"), prompt="x"
        )
    assert caught.value.status_code == 413 and "too large" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.images.create_variation(image=image, extra_body={"strength": 1.5})
    assert caught.value.body["param"] == "strength"
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.images.create_variation(image=("v.png", b"GIF89a nonsense", "image/gif"))
    assert "cannot decode" in str(caught.value) and caught.value.body["param"] == "image"


def test_a_request_caches_steps_as_its_cache_field_says(served: Served) -> None:
    """Step caching per request over HTTP (the stage has none): of 8 steps, warm-up 1 and one in 2 compute
    steps 0, 1, 3, 5 and the last: 3 cached, whatever the model's blocks and calls per step; ``/metrics``
    counts them. A bad setting is a 400 naming the field."""
    if served.edits:
        return
    cache = {"policy": "fixed", "compute_every": 2, "warmup_steps": 1, "final_steps": 1}
    body = {"num_inference_steps": 8, "guidance_scale": served.guidance, "seed": 4}

    def image(extra: dict[str, object]) -> np.ndarray:
        result = served.client.images.generate(prompt="a red fox", size="64x64", extra_body={**body, **extra})
        return decode(result.data[0].b64_json)

    uncached = image({})
    computed = served.server.metric("omni_diffusion_computed_blocks_total")
    cached = served.server.metric("omni_diffusion_cached_blocks_total")
    assert cached == 0
    stepped = image({"cache": cache})
    computed = served.server.metric("omni_diffusion_computed_blocks_total") - computed
    cached = served.server.metric("omni_diffusion_cached_blocks_total") - cached
    assert cached > 0 and cached * 5 == computed * 3
    assert stepped.std() > 10 and not np.array_equal(stepped, uncached)
    assert np.array_equal(image({"cache": {"policy": "none"}}), uncached)
    with pytest.raises(openai.BadRequestError) as caught:
        image({"cache": {"policy": "often"}})
    assert "cache" in str(caught.value) and "often" in str(caught.value)


def test_models_and_health(served: Served) -> None:
    assert [m.id for m in served.client.models.list().data] == [served.name]
    body = http_client.get(served.server.base_url + "/health", timeout=10).json()
    assert body["status"] == "ok" and list(body["stages"]) == ["0"]
    assert body["stages"]["0"]["name"] == "diffusion" and body["stages"]["0"]["healthy"] is True


def test_vllm_bench_serve_omni_measures_the_server_and_its_saved_result_matches_what_ran(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``vllm bench serve --omni`` (in process: the stock script's hand-off is test_bench_serve.py's) on the
    tiny SD3, plain and streamed: its saved JSON says what was sent, and the server's /metrics agree (the
    denoising steps of exactly those requests ran; its queue and stage times are in the result)."""
    if served.family != "sd3":
        pytest.skip("checked on the tiny SD3")
    from vllm_omni_plugin.bench.serve import main as bench_main

    for workload in ("generations", "stream"):
        steps = served.server.metric("omni_diffusion_denoise_steps_total")
        out = tmp_path / workload
        argv = ["--omni", "--base-url", served.server.base_url, "--workload", workload, "--num-prompts", "4",
                "--max-concurrency", "2", "--size", "64x64,32x32", "--num-inference-steps", "2,3",
                "--save-result", "--save-detailed", "--result-dir", str(out)]  # fmt: skip
        assert bench_main(argv) == 0
        assert "Serving Benchmark Result (images)" in capsys.readouterr().out
        (path,) = out.glob("*.json")
        result = json.loads(path.read_text())
        assert (result["model_id"], result["completed"], result["failed"]) == (served.name, 4, 0)
        ran = served.server.metric("omni_diffusion_denoise_steps_total") - steps
        assert ran == sum(r["num_inference_steps"] for r in result["requests"])
        server = result["server"]
        assert server["diffusion_requests"] == 4 and server["mean_diffusion_queue_ms"] >= 0
        assert server["mean_stage_0:diffusion_ms"] > 0
        if workload == "stream":
            assert all(
                t is not None and 0 < t <= e
                for t, e in zip(result["ttfps"], result["latencies"], strict=True)
            )
            assert result["p99_ttfp_ms"] > 0


# --- streamed answers -----------------------------------------------------------------------------------
# Last on each family's server: the request aborted below comes after every test that counts its steps,
# images or /health's inflight requests.


def test_a_streamed_generation_gives_its_previews_then_the_image_it_gives_unstreamed(served: Served) -> None:
    if served.family != "sd3":
        pytest.skip("streamed generations are checked on the tiny SD3")
    ask = {"model": served.name, "prompt": "a lighthouse at dusk", "size": "64x64"}
    extra = {"seed": 5, "num_inference_steps": 8}
    plain = pixels(served.client.images.generate(**ask, extra_body=extra).data[0].b64_json)
    events = list(served.client.images.generate(**ask, stream=True, partial_images=2, extra_body=extra))
    assert assert_streamed(events, "image_generation", 2, plain) == []  # no AR stage: nothing first


def test_a_streamed_edit_gives_its_previews_then_the_image_it_gives_unstreamed(served: Served) -> None:
    if served.family != "qwen_image_edit":
        pytest.skip("streamed edits are checked on the tiny Qwen-Image-Edit")
    source = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)  # not square
    ask = {"model": served.name, "prompt": "make it blue", "image": ("s.png", png(source))}
    extra = {"seed": 9, "num_inference_steps": 6}
    plain = pixels(served.client.images.edit(**ask, extra_body=extra).data[0].b64_json)
    events = list(served.client.images.edit(**ask, stream=True, partial_images=2, extra_body=extra))
    assert assert_streamed(events, "image_edit", 2, plain) == []


def test_a_client_that_closes_the_stream_after_its_first_preview_aborts_the_request(served: Served) -> None:
    """The preview thread holds once it has handed over the first preview, so the call waits before its
    own decode; the client, once it has that preview, closes the stream; the server notices and aborts;
    released, the DiT drops the request at its step end: no image is made."""
    if served.family != "sd3":
        pytest.skip("a closed stream is checked on the tiny SD3")
    server = served.server
    labels = {"stage": "0", "name": "diffusion"}
    drops = server.metric("omni_stage_aborted_requests_total", **labels, where="batch")
    gone = server.metric("omni_client_disconnects_total", endpoint="images/generations")
    made = server.metric("omni_images_generated_total", endpoint="images/generations")
    ask = {"model": served.name, "prompt": "a painting nobody waits for", "size": "64x64"}
    with server.hold("dit.preview") as hold:
        stream = served.client.images.generate(
            **ask, stream=True, partial_images=3, extra_body={"num_inference_steps": 40}
        )
        first = next(iter(stream))
        assert first.type == "image_generation.partial_image" and first.partial_image_index == 0
        hold.wait(alive=server.alive)
        stream.close()
        wait_for_metric(
            lambda sample: server.metric(sample, endpoint="images/generations"),
            "omni_client_disconnects_total",
            gone + 1,
        )
    wait_for_metric(
        lambda sample: server.metric(sample, **labels, where="batch"),
        "omni_stage_aborted_requests_total",
        drops + 1,
    )
    assert server.metric("omni_images_generated_total", endpoint="images/generations") == made
    stages = http_client.get(server.base_url + "/health", timeout=10).json()["stages"]
    assert all(r["inflight"] == 0 for s in stages.values() for r in s["replicas"])


def test_streaming_takes_one_image_per_request(served: Served) -> None:
    if served.family != "sd3":
        pytest.skip("the API refuses these streams alike for every family: checked on the tiny SD3")
    url = served.server.base_url + "/v1/images/generations"
    response = http_client.post(url, json={"prompt": "two", "n": 2, "stream": True}, timeout=60)
    assert response.status_code == 400 and "send n=1" in response.json()["error"]["message"]
    response = http_client.post(url, json={"prompt": "many", "stream": True, "partial_images": 4}, timeout=60)
    assert response.status_code == 400 and "partial_images" in response.json()["error"]["message"]


# --- the offline API ------------------------------------------------------------------------------------


def test_offline_api_serves_a_diffusers_model_without_a_config(tiny_sd3: Path) -> None:
    from vllm_omni_plugin.entrypoints.omni import Omni
    from vllm_omni_plugin.stage.orchestrator import OmniRequest

    prompts = ["a red fox", "a photo of a cat", "the sky is blue"]
    with Omni(str(tiny_sd3)) as omni:
        assert omni.deployment.pipeline == "diffusion"
        results = omni.generate(
            [
                OmniRequest(
                    prompt=p, height=64, width=64, seed=i, num_inference_steps=STEPS, guidance_scale=2.0
                )
                for i, p in enumerate(prompts)
            ]
        )
        (unsized, too_big) = omni.generate(
            [
                OmniRequest(prompt="a red fox", seed=7, num_inference_steps=STEPS, guidance_scale=2.0),
                OmniRequest(prompt="a red fox", height=2048, width=2048, num_inference_steps=STEPS),
            ]
        )
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        assert result.ok, result.error
        direct = reference_image(
            tiny_sd3, prompt=prompt, seed=i, height=64, width=64, steps=STEPS, guidance=2.0
        )
        assert_within_one_level(result.output.image, direct)
    # the pipeline's own default size, applied before the first stage; a size it cannot make refused there
    direct = reference_image(
        tiny_sd3, prompt="a red fox", seed=7, height=None, width=None, steps=STEPS, guidance=2.0
    )
    assert unsized.ok, unsized.error
    assert unsized.output.image.shape == direct.shape
    assert not too_big.ok and "at most 1024 pixels" in (too_big.error or ""), too_big.error
    assert too_big.error_stage == 0 and too_big.exception is not None


def test_offline_api_in_process_stage_edits_and_counts_steps(
    tiny_qwen_image_edit: Path, tmp_path: Path
) -> None:
    """``process: false``: the stage runs in the caller's process; its steps are counted as they run."""
    import asyncio

    from vllm_omni_plugin.stage.async_omni import AsyncOmni
    from vllm_omni_plugin.stage.orchestrator import OmniRequest

    deploy = tmp_path / "inline.yaml"
    deploy.write_text(
        "pipeline: diffusion\nstages:\n  - stage_id: 0\n    process: false\n    max_batch_size: 4\n"
    )
    source = source_image(64, seed=4)

    async def main() -> tuple[list, int, int | None]:
        omni = await AsyncOmni.create(str(tiny_qwen_image_edit), deploy_config=str(deploy))
        try:
            results = await asyncio.gather(
                omni.generate(
                    OmniRequest(prompt="make it red", height=64, width=64, seed=5, num_inference_steps=2,
                                guidance_scale=1.0, images=[source])
                ),
                omni.generate(OmniRequest(prompt="no source image", height=64, width=64, num_inference_steps=2)),
            )  # fmt: skip
            client = omni.pools[0].clients[0]
            return list(results), client.denoise_steps, client.pid
        finally:
            await omni.shutdown()

    (edited, refused), steps, pid = asyncio.run(main())
    assert edited.ok, edited.error
    direct = reference_image(
        tiny_qwen_image_edit,
        prompt="make it red",
        seed=5,
        height=64,
        width=64,
        steps=2,
        guidance=1.0,
        images=[source],
    )
    assert_within_one_level(edited.output.image, direct)
    assert not refused.ok and "needs a source image" in (refused.error or "")
    assert steps == 2 and pid == os.getpid()  # one request ran, two steps, here


# --- refused at start-up --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ({"_class_name": "DDPMPipeline"}, "DDPMPipeline cannot be served: its __call__ takes no prompt"),
        (None, "cannot tell which pipeline"),
    ],
    ids=["no-usable-call", "no-model-index"],
)
def test_serve_refuses_what_it_cannot_drive_with_one_line(
    tmp_path: Path, index: dict | None, message: str, vllm_cli: VllmForks
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    if index is not None:
        (model / "model_index.json").write_text(json.dumps(index))
    result = vllm_cli.run("serve", str(model), "--omni", "--port", str(free_port()), env=cpu_test_env())
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
