"""Limits checked before any stage runs, and input work kept off the event loop (the fast tier: the API
app in this process over fake replicas). What needs a real model (its token limits, its image count) is
in ``test_hostile_inputs.py``."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from helpers import FakePlacement, app_client, fake_deployment
from vllm_omni_testkit.holds import HOLD_DIR_ENV, HOOKS, Hold


def running(tmp_path: Path, *flags: str) -> Any:
    return app_client(fake_deployment(tmp_path), FakePlacement(), "--served-model-name", "fake", *flags)


def error(response: httpx.Response, status: int = 400) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 90, dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_prompts_longer_than_the_operator_allows_are_refused_before_anything_tokenizes_them(
    tmp_path: Path,
) -> None:
    async def main() -> list[httpx.Response]:
        async with running(tmp_path, "--image-max-prompt-chars", "100") as (client, _):
            return [
                await client.post("/v1/images/generations", json={"prompt": "x" * 101}),
                await client.post(
                    "/v1/images/generations", json={"prompt": "a cat", "negative_prompt": "y" * 500}
                ),
                await client.post(
                    "/v1/images/edits", data={"prompt": "z" * 150}, files={"image": ("a.png", png(32, 32))}
                ),
                await client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "w" * 120}], "modalities": ["image"]},
                ),
                await client.post("/v1/images/generations", json={"prompt": "x" * 100, "size": "64x64"}),
            ]

    long_prompt, long_negative, long_edit, long_chat, fits = asyncio.run(main())
    assert (
        error(long_prompt)
        == "prompt is 101 characters; this server accepts at most 100 (--image-max-prompt-chars)"
    )
    assert error(long_negative).startswith("negative_prompt is 500 characters")
    assert error(long_edit).startswith("prompt is 150 characters")
    assert error(long_chat).startswith("messages is 120 characters")
    assert fits.status_code == 200, fits.text


def test_the_default_prompt_limit_refuses_a_30_mb_prompt_at_once(tmp_path: Path) -> None:
    async def main() -> httpx.Response:
        async with running(tmp_path) as (client, _):
            return await client.post("/v1/images/generations", json={"prompt": "a red fox " * 3_000_000})

    assert "prompt is 30000000 characters; this server accepts at most 32000" in error(asyncio.run(main()))


@pytest.mark.parametrize(("width", "height"), [(4000, 1), (1, 300), (402, 2)])
def test_source_images_of_extreme_aspect_ratio_are_refused_naming_it(
    tmp_path: Path, width: int, height: int
) -> None:
    async def main() -> httpx.Response:
        async with running(tmp_path) as (client, _):
            files = {"image": ("thin.png", png(width, height))}
            return await client.post("/v1/images/edits", data={"prompt": "a cat"}, files=files)

    message = error(asyncio.run(main()))
    assert f"is {width}x{height}, an aspect ratio over 200:1; this server accepts at most 200:1" in message


def test_health_answers_while_a_request_is_worked_on_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's input work (its stage-input processing, its token counts) runs on the input worker:
    held there, it holds neither /health nor the other requests' answers that need no input work."""
    holds = tmp_path / "holds"
    holds.mkdir()
    monkeypatch.setenv(HOLD_DIR_ENV, str(holds))
    for name, value in HOOKS.items():
        monkeypatch.setenv(name, value)

    async def main() -> tuple[httpx.Response, httpx.Response, httpx.Response, str]:
        async with running(tmp_path) as (client, _):
            with Hold(holds, "api.input") as hold:
                work = asyncio.ensure_future(
                    client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64"})
                )
                held = await asyncio.to_thread(hold.wait, 30)
                health = await client.get("/health")
                models = await client.get("/v1/models")
                assert not work.done()
            return await work, health, models, held

    answered, health, models, held = asyncio.run(main())
    assert held  # the processor's name
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert models.status_code == 200
    assert answered.status_code == 200, answered.text
