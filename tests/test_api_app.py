"""The API app in-process on vLLM's ``build_app`` with a stand-in runtime: what needs no real stages
(response_format=url and the media route, ``--api-key``, how a failed result maps to a status)."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from vllm_omni_plugin.entrypoints.api_server import OmniServer, ServerSettings, build_api_app
from vllm_omni_plugin.entrypoints.cli import build_parser
from vllm_omni_plugin.entrypoints.openai_images import ImageLimits
from vllm_omni_plugin.stage.errors import StageDeadError, StageError
from vllm_omni_plugin.stage.orchestrator import OmniRequest, OmniResult

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


class FakeClient:
    replica_id = 0
    restarts = 0
    inflight: set[str] = set()

    def __init__(self, healthy: bool = True) -> None:
        self.healthy = healthy
        self.state = SimpleNamespace(value="ready" if healthy else "restarting")


class FakePool:
    def __init__(self, stage_id: int, name: str, healthy: bool = True) -> None:
        self.stage_id, self.name = stage_id, name
        self.clients = [FakeClient(healthy)]
        self.queue_depth = 0

    @property
    def healthy(self) -> bool:
        return all(c.healthy for c in self.clients)

    def health(self) -> dict[str, Any]:
        return {
            "stage_id": self.stage_id,
            "name": self.name,
            "healthy": self.healthy,
            "replicas": [
                {"replica_id": 0, "state": self.clients[0].state.value, "inflight": 0, "restarts": 0}
            ],
        }


class FakeOmni:
    """Draws a flat image of the requested size, or fails the way ``outcome`` says."""

    def __init__(self, outcome: Callable[[OmniRequest], OmniResult] | None = None) -> None:
        self.deployment = SimpleNamespace(pipeline="glm_image", model="/models/glm-image", stages=[])
        self.pools = {0: FakePool(0, "ar"), 1: FakePool(1, "dit")}
        self.connectors: dict[str, Any] = {}
        self.outcome = outcome

    async def generate(self, request: OmniRequest) -> OmniResult:
        if self.outcome is not None:
            return self.outcome(request)
        image = np.full((request.height, request.width, 3), 127, dtype=np.uint8)
        return OmniResult(request.request_id, output=SimpleNamespace(image=image), timings={"total": 0.01})


def make_app(omni: FakeOmni, media_dir: Path | None = None) -> Any:
    args = build_parser().parse_args(["serve", "/models/glm-image", "--omni", "--api-key", KEY])
    settings = ServerSettings(
        served_model_names=["glm-image"],
        limits=ImageLimits(default_width=64, default_height=64),
        media_dir=str(media_dir) if media_dir else None,
    )
    return build_api_app(args, OmniServer(omni, settings))  # type: ignore[arg-type]


def call(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://omni.test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_response_format_url_serves_the_image_from_the_media_dir(tmp_path: Path) -> None:
    app = make_app(FakeOmni(), media_dir=tmp_path)
    body = {"prompt": "a cat", "size": "96x64", "response_format": "url", "n": 2}
    response = call(app, "POST", "/v1/images/generations", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    urls = [item["url"] for item in response.json()["data"]]
    assert len(urls) == 2 and all(u.startswith("http://omni.test/media/") for u in urls)
    image = call(app, "GET", urls[0].removeprefix("http://omni.test"))  # no key: the name is the secret
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(image.content)).size == (96, 64)
    assert len(list(tmp_path.iterdir())) == 2
    assert call(app, "GET", "/media/../etc.png").status_code == 404


def test_api_key_guards_v1_but_not_health() -> None:
    app = make_app(FakeOmni())
    response = call(app, "POST", "/v1/images/generations", json={"prompt": "a cat"})
    assert response.status_code == 401
    assert call(app, "GET", "/v1/models").status_code == 401
    assert call(app, "GET", "/v1/models", headers=AUTH).json()["data"][0]["id"] == "glm-image"
    assert call(app, "GET", "/health").status_code == 200


def failing(exc: BaseException, message: str) -> Callable[[OmniRequest], OmniResult]:
    return lambda r: OmniResult(r.request_id, error=message, error_stage=1, exception=exc)


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (StageDeadError("stage 1 (dit) replica 0 died", stage_id=1), 503),
        (StageError("the DiT ran out of memory", stage_id=1), 500),
        (RuntimeError("a processor bug"), 500),
        (ValueError("the prompt is too long for max_model_len"), 400),
    ],
)
def test_failed_results_map_to_statuses_without_tracebacks(exc: BaseException, status: int) -> None:
    app = make_app(FakeOmni(failing(exc, str(exc))))
    response = call(app, "POST", "/v1/images/generations", json={"prompt": "a cat"}, headers=AUTH)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == status and error["message"] == str(exc) and "Traceback" not in response.text


def test_health_is_503_with_the_stage_states_while_a_stage_is_down() -> None:
    omni = FakeOmni()
    omni.pools[1] = FakePool(1, "dit", healthy=False)
    response = call(make_app(omni), "GET", "/health")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["stages"]["0"]["healthy"] is True and body["stages"]["1"]["healthy"] is False
    assert body["stages"]["1"]["replicas"][0]["state"] == "restarting"


def test_vllm_routes_needing_a_text_engine_are_gone() -> None:
    app = make_app(FakeOmni())
    paths = {getattr(r, "path", None) for r in app.router.routes}
    assert {"/tokenize", "/detokenize", "/load", "/ping", "/invocations"}.isdisjoint(paths)
    assert {
        "/metrics",
        "/version",
        "/v1/images/generations",
        "/v1/images/edits",
        "/v1/chat/completions",
    } <= paths
    assert call(app, "GET", "/version").status_code == 200
