"""A GLM-Image request that cannot fit its AR stage is refused (HTTP 400, with the numbers) before any
stage runs: prompt text, source images and generated tokens all count against ``max_model_len``.

The model is the tiny GLM-Image with the real GLM-Image image processor (``tests/data``: patch 16, no
merge, min/max pixels 512^2/2048^2), so a 2048x2048 source costs its real 4096 tokens; the deployment is
the packaged ``deploy/glm_image.yaml`` (``max_model_len`` 8192). The app runs over the real runtime with
fake replicas that record what reaches them; the stage-input processor is GLM-Image's real one.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from PIL import Image

from helpers import FakePlacement, app_client
from vllm_omni_plugin.config import PLATFORMS, ResolvedDeployment, resolve_deployment
from vllm_omni_plugin.families.glm_image.processors import glm_image_ar_tokens, request2ar
from vllm_omni_plugin.stage.core_types import StageLLMCoreOutput, StageLLMCoreRequest
from vllm_omni_plugin.stage.orchestrator import OmniRequest, ProcessorContext

REPO = Path(__file__).resolve().parent.parent
REAL_IMAGE_PROCESSOR = Path(__file__).parent / "data" / "glm_image_real_image_processor.yaml"
DEPLOY = REPO / "deploy" / "glm_image.yaml"
MAX_MODEL_LEN = 8192
MODEL = "glm-image"
PROMPT = "make the sky purple"


@pytest.fixture(scope="module")
def real_processor_model(tiny_glm_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GLM-Image whose ``processor/`` carries the real image-processor config."""
    model = tmp_path_factory.mktemp("glm_image_real_processor") / "glm-image"
    model.mkdir()
    for child in tiny_glm_image.iterdir():
        if child.name != "processor":
            os.symlink(child.resolve(), model / child.name)
    shutil.copytree(tiny_glm_image / "processor", model / "processor")
    config_path = model / "processor" / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["image_processor"].update(yaml.safe_load(REAL_IMAGE_PROCESSOR.read_text())["image_processor"])
    config_path.write_text(json.dumps(config, indent=2))
    return model


@pytest.fixture(scope="module")
def deployment(real_processor_model: Path) -> ResolvedDeployment:
    resolved = resolve_deployment(
        str(real_processor_model), deploy_config=str(DEPLOY), platform=PLATFORMS["cpu"]
    )
    assert resolved.stages[0].engine_args["max_model_len"] == MAX_MODEL_LEN  # the packaged deployment's
    return resolved


def png(width: int, height: int, color: tuple[int, int, int] = (40, 90, 200)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


class RecordingAR:
    """The fake AR replica: records each request and answers it as GLM-Image's AR stage on vLLM would
    (codebook ids, the source images' prior tokens), within ``max_model_len`` as vLLM keeps it: a prompt
    that fills it is rejected, and generation stops once prompt and output reach it."""

    def __init__(self) -> None:
        self.requests: list[StageLLMCoreRequest] = []

    def __call__(self, request: StageLLMCoreRequest) -> StageLLMCoreOutput:
        self.requests.append(request)
        prompt = len(request.prompt_token_ids)
        if prompt >= MAX_MODEL_LEN:
            raise ValueError(f"The decoder prompt (length {prompt}) is longer than the maximum model length")
        images = (request.multi_modal_data or {}).get("image") or []
        grids = [[1, img.height // 32, img.width // 32] for img in images]
        generated = min(int(request.sampling_params["max_tokens"]), MAX_MODEL_LEN - prompt)
        return StageLLMCoreOutput(
            request_id=request.request_id,
            stage_id=request.stage_id,
            token_ids=[7] * generated,
            finish_reason="length",
            stage_outputs={
                "source_token_ids": [[0] * (g[1] * g[2]) for g in grids],
                "source_grids": grids,
            }
            if images
            else {},
        )


@contextlib.asynccontextmanager
async def app(
    deployment: ResolvedDeployment,
) -> AsyncIterator[tuple[httpx.AsyncClient, FakePlacement, RecordingAR]]:
    ar = RecordingAR()
    placement = FakePlacement({0: ar})
    async with app_client(deployment, placement, "--served-model-name", MODEL, timeout=120) as (client, _):
        yield client, placement, ar


def served(placement: FakePlacement) -> dict[int, list[str]]:
    """What each stage's replicas were asked to run."""
    return {sid: [rid for c in clients for rid in c.served] for sid, clients in placement.clients.items()}


async def edit(client: httpx.AsyncClient, sources: list[tuple[int, int]], size: str) -> httpx.Response:
    files = [("image[]", (f"src{i}.png", png(w, h), "image/png")) for i, (w, h) in enumerate(sources)]
    data = {"prompt": PROMPT, "size": size, "model": MODEL}
    return await client.post("/v1/images/edits", files=files, data=data)


async def chat(client: httpx.AsyncClient, sources: list[tuple[int, int]], size: str) -> httpx.Response:
    parts: list[dict[str, Any]] = [{"type": "text", "text": PROMPT}]
    for w, h in sources:
        uri = "data:image/png;base64," + base64.b64encode(png(w, h)).decode()
        parts.append({"type": "image_url", "image_url": {"url": uri}})
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": parts}],
        "modalities": ["image"],
        "size": size,
    }
    return await client.post("/v1/chat/completions", json=body)


SEND = {"edits": edit, "chat": chat}
SOURCE_PARAM = {"edits": "image", "chat": "messages"}


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    return error


# --- the count itself ---------------------------------------------------------------------------------


def test_source_tokens_follow_the_real_processor_rule(real_processor_model: Path) -> None:
    """smart_resize halves, clamps to 512^2..2048^2 pixels on the 16-pixel grid, one token per patch."""
    model = str(real_processor_model)

    def tokens(w: int, h: int) -> int:
        return glm_image_ar_tokens(model, PROMPT, [(w, h)], 1024, 1024, 10**6).image_tokens[0]

    assert tokens(2048, 2048) == (2048 // 2 // 16) ** 2 == 4096
    assert tokens(1024, 1024) == (1024 // 2 // 16) ** 2 == 1024
    assert tokens(4096, 4096) == 4096  # max_pixels clamps: never more than a 2048x2048 source
    # 300x500 is scaled up to the 512-pixel short side first: x 512/300, halved, on the 16 grid: 16 x 27.
    assert tokens(300, 500) == 16 * 27


@pytest.mark.parametrize(
    ("sources", "width", "height"),
    [
        ([], 1024, 1024),
        ([], 2048, 1536),
        ([(2048, 2048)], 2048, 2016),
        ([(300, 500), (1024, 768)], 1024, 1024),
    ],
)
def test_the_count_is_what_request2ar_builds(
    deployment: ResolvedDeployment, sources: list[tuple[int, int]], width: int, height: int
) -> None:
    """Exact (limit 0) and bound (no limit) against the prompt the real processor makes."""
    model = deployment.model
    request = OmniRequest(
        prompt=PROMPT, width=width, height=height, images=[Image.new("RGB", s, (9, 9, 9)) for s in sources]
    )
    ar = request2ar({}, ProcessorContext(model, deployment, 0, request))
    exact = glm_image_ar_tokens(model, PROMPT, sources, width, height, 0)
    assert exact.exact
    assert exact.prompt_tokens + sum(exact.image_tokens) == len(ar.prompt_token_ids)
    assert exact.generated_tokens == ar.sampling_params["max_tokens"]
    bound = glm_image_ar_tokens(model, PROMPT, sources, width, height, 10**6)
    assert not bound.exact and bound.prompt_tokens >= exact.prompt_tokens
    assert (bound.image_tokens, bound.generated_tokens) == (exact.image_tokens, exact.generated_tokens)


# --- through the API ----------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["edits", "chat"])
def test_one_2048_source_with_a_2048_target_is_refused_before_any_stage(
    deployment: ResolvedDeployment, endpoint: str
) -> None:
    """Its generated tokens (4097) alone fit 8192; with the source's 4096 and the prompt they do not."""
    exact = glm_image_ar_tokens(deployment.model, PROMPT, [(2048, 2048)], 2048, 2048, MAX_MODEL_LEN)
    assert exact.image_tokens == (4096,) and exact.generated_tokens == 4097 and exact.total > MAX_MODEL_LEN

    async def main() -> None:
        async with app(deployment) as (client, placement, ar):
            error = error_of(await SEND[endpoint](client, [(2048, 2048)], "2048x2048"))
            message = error["message"]
            assert error["param"] == "size"
            assert f"needs {exact.total} AR tokens" in message
            assert f"max_model_len {MAX_MODEL_LEN}" in message
            assert (
                f"prompt {exact.prompt_tokens} + source images 4096 + generated 4097 (a 2048x2048 image) "
                f"= {exact.total}" in message
            )
            assert f"leave {MAX_MODEL_LEN - exact.prompt_tokens - 4096} tokens for the image" in message
            assert "ask for at most 2016x2016" in message
            assert ar.requests == [] and served(placement) == {0: [], 1: []}

    asyncio.run(main())


@pytest.mark.parametrize("endpoint", ["edits", "chat"])
def test_four_2048_sources_are_refused_by_the_prompt_alone(
    deployment: ResolvedDeployment, endpoint: str
) -> None:
    async def main() -> None:
        async with app(deployment) as (client, placement, ar):
            error = error_of(await SEND[endpoint](client, [(2048, 2048)] * 4, "512x512"))
            message = error["message"]
            assert error["param"] == SOURCE_PARAM[endpoint]
            assert "source images 16384 (4096, 4096, 4096, 4096)" in message
            assert "generated 257 (a 512x512 image)" in message
            assert "the prompt and source images alone leave no room" in message
            assert "send fewer or smaller source images" in message
            assert ar.requests == [] and served(placement) == {0: [], 1: []}

    asyncio.run(main())


@pytest.mark.parametrize("endpoint", ["edits", "chat"])
def test_a_request_that_just_fits_runs(deployment: ResolvedDeployment, endpoint: str) -> None:
    """2048x2016 from a 2048x2048 source: 32 tokens short of 2048x2048's refusal, within 8192."""
    fits = glm_image_ar_tokens(deployment.model, PROMPT, [(2048, 2048)], 2016, 2048, MAX_MODEL_LEN)
    assert MAX_MODEL_LEN - 64 < fits.total <= MAX_MODEL_LEN

    async def main() -> None:
        async with app(deployment) as (client, placement, ar):
            response = await SEND[endpoint](client, [(2048, 2048)], "2016x2048")
            assert response.status_code == 200, response.text[:300]
            [request] = ar.requests
            held = len(request.prompt_token_ids) + request.sampling_params["max_tokens"]
            assert held == fits.total <= MAX_MODEL_LEN
            assert len(served(placement)[1]) == 1

    asyncio.run(main())


def test_text_to_image_counts_the_prompt(deployment: ResolvedDeployment) -> None:
    """A 2048x2048 image (4353 generated tokens) with a prompt too long to sit beside it."""
    long_prompt = " ".join(["a red fox in the snow"] * 800)
    count = glm_image_ar_tokens(deployment.model, long_prompt, [], 2048, 2048, MAX_MODEL_LEN)
    assert count.generated_tokens == 64 * 64 + 16 * 16 + 1 < MAX_MODEL_LEN < count.total

    async def main() -> None:
        async with app(deployment) as (client, placement, ar):
            body = {"prompt": long_prompt, "size": "2048x2048", "model": MODEL}
            error = error_of(await client.post("/v1/images/generations", json=body))
            assert error["param"] == "size"
            assert f"prompt {count.prompt_tokens} + source images 0 + generated 4353" in error["message"]
            assert f"the prompt leaves {MAX_MODEL_LEN - count.prompt_tokens} tokens" in error["message"]
            assert ar.requests == [] and served(placement) == {0: [], 1: []}
            # The same prompt with an image small enough runs.
            w, h = count.largest_fit
            response = await client.post("/v1/images/generations", json={**body, "size": f"{w}x{h}"})
            assert response.status_code == 200, response.text[:300]
            [request] = ar.requests
            assert len(request.prompt_token_ids) + request.sampling_params["max_tokens"] <= MAX_MODEL_LEN

    asyncio.run(main())


def test_a_source_the_processor_cannot_take_is_refused_before_any_stage(
    deployment: ResolvedDeployment,
) -> None:
    async def main() -> None:
        async with app(deployment) as (client, placement, ar):
            error = error_of(await edit(client, [(2048, 256)], "512x512"))
            assert error["param"] == "image"
            assert "source image 1 (2048x256)" in error["message"] and "aspect ratio" in error["message"]
            assert ar.requests == []

    asyncio.run(main())
